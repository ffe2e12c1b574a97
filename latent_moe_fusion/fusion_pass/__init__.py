"""The Inductor fusion pass (docs/design.md, section 3)."""

from .cache_record import FusionRecord, record_fusion
from .capabilities import DISABLE_ENV, Capabilities, agree_capabilities
from .config import FusionConfig
from .install import ChainedGraphPass, install
from .latent_pass import LatentMoEFusionPass
from .report import FusionReport, MatchedBlock, MatchedRouting

__all__ = [
    "DISABLE_ENV",
    "Capabilities",
    "ChainedGraphPass",
    "FusionConfig",
    "FusionRecord",
    "FusionReport",
    "LatentMoEFusionPass",
    "MatchedBlock",
    "MatchedRouting",
    "agree_capabilities",
    "install",
    "record_fusion",
]
