"""Alpha computers: pick the teacher weight α of the geometric mixture q ∝ π_θ^(1−α)·π_t^α.

Pure tensor math, with no vLLM import. α is always the teacher weight.

    from alpha import get_alpha_computer, geometric_mix
    ac = get_alpha_computer("kl_symmetry", alpha_min=0.0, alpha_max=1.0)
    a = ac(logp_theta, logp_teacher)          # [B]
    logq = geometric_mix(logp_theta, logp_teacher, a)   # [B, V]
"""

from alpha.base import AlphaComputer, AlphaResult
from alpha.methods import EntropyAlpha, ESSBalanceAlpha, FixedAlpha, KLSymmetryAlpha, TrustRegionAlpha
from alpha.mixing import geometric_log_weights, geometric_log_weights_teachers, geometric_mix, geometric_mix_teachers
from alpha.registry import (
    ENTRY_POINT_GROUP,
    alpha_methods_for_several_teachers,
    available_alpha_methods,
    get_alpha_computer,
    register_alpha_computer,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "AlphaComputer",
    "AlphaResult",
    "ESSBalanceAlpha",
    "EntropyAlpha",
    "FixedAlpha",
    "KLSymmetryAlpha",
    "TrustRegionAlpha",
    "alpha_methods_for_several_teachers",
    "available_alpha_methods",
    "geometric_log_weights",
    "geometric_log_weights_teachers",
    "geometric_mix",
    "geometric_mix_teachers",
    "get_alpha_computer",
    "register_alpha_computer",
]
