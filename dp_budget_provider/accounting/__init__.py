"""Differential-privacy accounting: mechanisms, RDP composition, conversion, calibration, noise.

Pure Python and numpy: no database, no Airflow. The ledger and the Airflow adapters
build on these names.
"""

from dp_budget_provider.accounting.accountant import (
    AccountantState,
    EpsilonBound,
    RDPAccountant,
    epsilon_bound,
)
from dp_budget_provider.accounting.analytic_gaussian import (
    calibrate_analytic_gaussian,
    gaussian_delta,
    gaussian_epsilon,
)
from dp_budget_provider.accounting.calibration import (
    CalibrationInfeasible,
    plan_noise_multiplier,
    plan_noise_multiplier_for,
    plan_noise_multiplier_where,
)
from dp_budget_provider.accounting.conversion import (
    CONVERSIONS,
    Conversion,
    advanced_composition,
    basic_composition,
    continuous_optimal_epsilon,
    rdp_to_epsilon,
    zcdp_to_dp,
)
from dp_budget_provider.accounting.mechanisms import (
    GaussianMechanism,
    LaplaceMechanism,
    Mechanism,
    PoissonSubsampledGaussianMechanism,
    PureDPMechanism,
    ZCDPMechanism,
)
from dp_budget_provider.accounting.noise import (
    discrete_gaussian_noise,
    discrete_laplace_noise,
    sample_discrete_gaussian,
    sample_discrete_laplace,
    unsafe_float_gaussian_noise,
    unsafe_float_laplace_noise,
)
from dp_budget_provider.accounting.orders import DEFAULT_ORDERS

__all__ = [
    "CONVERSIONS",
    "DEFAULT_ORDERS",
    "AccountantState",
    "CalibrationInfeasible",
    "Conversion",
    "EpsilonBound",
    "GaussianMechanism",
    "LaplaceMechanism",
    "Mechanism",
    "PoissonSubsampledGaussianMechanism",
    "PureDPMechanism",
    "RDPAccountant",
    "ZCDPMechanism",
    "advanced_composition",
    "basic_composition",
    "calibrate_analytic_gaussian",
    "continuous_optimal_epsilon",
    "discrete_gaussian_noise",
    "discrete_laplace_noise",
    "epsilon_bound",
    "gaussian_delta",
    "gaussian_epsilon",
    "plan_noise_multiplier",
    "plan_noise_multiplier_for",
    "plan_noise_multiplier_where",
    "rdp_to_epsilon",
    "sample_discrete_gaussian",
    "sample_discrete_laplace",
    "unsafe_float_gaussian_noise",
    "unsafe_float_laplace_noise",
    "zcdp_to_dp",
]
