"""`python -m latent_moe_fusion demo` on CPU (short run): report, node counts, errors and times printed."""

import re

from latent_moe_fusion.__main__ import main


def test_demo_prints_report_errors_and_times(capsys):
    assert main(["demo", "--device", "cpu", "--tokens", "16", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "1 block(s) rewritten" in out
    assert re.search(r"post-grad nodes: compiled \d+, compiled \+ fused \d+", out)
    rows = {}
    for line in out.splitlines():
        m = re.match(r"(eager|compiled \+ fused|compiled|op-level producer \+ tail)\s+(\S+)\s+(\S+)\s+(\S+)$", line)
        if m:
            rows[m.group(1)] = [float(v) for v in m.groups()[1:]]
    assert set(rows) == {"eager", "compiled", "compiled + fused", "op-level producer + tail"}, out
    for name, (vs_eager, vs_f64, ms) in rows.items():
        assert vs_eager <= 1e-2 and vs_f64 <= 1e-2 and ms > 0, (name, rows[name])
