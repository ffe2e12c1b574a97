"""Every CLI argument is checked: a bad value is one usage line on stderr and exit code 2, never a traceback."""

import subprocess
import sys

import pytest

from latent_moe_fusion.__main__ import parse

BAD = [
    (["inspect", "--tp", "0"], "argument --tp: expected an integer >= 1, got 0"),
    (["inspect", "--tp", "-1"], "argument --tp: expected an integer >= 1, got -1"),
    (["inspect", "--tp", "two"], "argument --tp: expected an integer >= 1, got 'two'"),
    (["inspect", "--tp", "3"], "--tp 3: shared_intermediate_size 128 is not divisible by the TP world size 3"),
    (["inspect", "--sp"], "--sp needs --tp N with N >= 2"),
    (["inspect", "--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    (["demo", "--tokens", "0"], "argument --tokens: expected an integer >= 1, got 0"),
    (["demo", "--tokens", "-1"], "argument --tokens: expected an integer >= 1, got -1"),
    (["demo", "--tokens", "1.5"], "argument --tokens: expected an integer >= 1, got '1.5'"),
    (["demo", "--repeats", "0"], "argument --repeats: expected an integer >= 1, got 0"),
    (["demo", "--ep-size", "0"], "argument --ep-size: expected an integer >= 1, got 0"),
    (["demo", "--ep-size", "5"], "--ep-size 5: num_experts 896 is not divisible by the expert-parallel size 5"),
    (["demo", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["plan", "--m", "0"], "argument --m: expected an integer >= 1, got 0"),
    (["plan", "--m", "-3"], "argument --m: expected an integer >= 1, got -3"),
    (["plan", "--m", "2", "--capability", "7.x"], "argument --capability: expected MAJOR.MINOR"),
    (["plan", "--m", "2", "--top-k", "20", "--experts", "8"], "--top-k 20 exceeds --experts 8"),
    (["plan", "--m", "2", "--latent", "100"], "--latent 100: MXFP4 weights need a multiple of 32"),
    (["plan-tail", "--m", "0"], "argument --m: expected an integer >= 1, got 0"),
    (["plan-tail", "--m", "8", "--world-size", "2"], "--mode local is one rank, got --world-size 2"),
    (["plan-tail", "--m", "8", "--mode", "hidden_scatter", "--world-size", "3"],
     "--hidden 7168 is not divisible by --world-size 3"),
    (["plan-tail", "--m", "8", "--mode", "scatter"], "argument --mode: invalid choice: 'scatter'"),
    (["plan-tail", "--m", "8", "--cute", "maybe"], "argument --cute: invalid choice: 'maybe'"),
    (["plan-tail", "--m", "8", "--capability", "9"], "argument --capability: expected MAJOR.MINOR"),
    (["plan-tail", "--m", "8", "--sms", "0"], "argument --sms: expected an integer >= 1, got 0"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_value_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m latent_moe_fusion " + argv[0]) and message in err, err
    assert "Traceback" not in err


GOOD = [
    (["inspect", "--tp", "1"], "tp", 1),
    (["inspect", "--tp", "2", "--sp"], "tp", 2),
    (["inspect", "--tp", "4"], "tp", 4),
    (["demo", "--tokens", "1"], "tokens", 1),
    (["demo", "--repeats", "1"], "repeats", 1),
    (["demo", "--ep-size", "1"], "ep_size", 1),
    (["demo", "--ep-size", "896"], "ep_size", 896),
]


@pytest.mark.parametrize(("argv", "field", "value"), GOOD, ids=[" ".join(a) for a, _, _ in GOOD])
def test_the_bounds_themselves_are_accepted(argv, field, value):
    assert getattr(parse(argv), field) == value


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message where CUDA is missing")
def test_cuda_without_a_gpu_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parse(["demo", "--device", "cuda"])
    assert exc.value.code == 2 and "no CUDA device is available here" in capsys.readouterr().err


def test_the_module_entry_point_prints_no_traceback():
    done = subprocess.run([sys.executable, "-m", "latent_moe_fusion", "demo", "--tokens", "-1"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert [line for line in done.stderr.splitlines() if "error:" in line] == [
        "python -m latent_moe_fusion demo: error: argument --tokens: expected an integer >= 1, got -1"]
