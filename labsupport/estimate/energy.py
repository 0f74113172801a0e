"""Back-of-envelope training energy: how many tokens, how long, how many joules.

Compute-optimal tokens (Hoffmann et al. 2022) give the training FLOPs, `flops.training_days` turns
them into time at some fraction of a device's peak, and time x devices x power x PUE is the
energy (Patterson et al. 2021). With D = 20 N tokens the compute is 6 N x 20 N = 120 N^2 FLOPs,
which is why the workshop's deck finds energy growing about as the square of the model size
(its estimates are `workshop.DECK_TRAINING_ENERGY_J`).
"""
from __future__ import annotations

from .flops import training_days

TOKENS_PER_PARAM = 20

# Assumption: AMD's Instinct MI250X datasheet gives 560 W peak board power for the OAM module,
# which holds two GCDs, each its own device to torch (as flops.PEAK_TFLOPS counts it): 280 W per
# GCD, an upper bound on what a GCD draws while it trains.
MI250X_GCD_WATTS = 280.0


def chinchilla_tokens(n_params: float) -> float:
    """Compute-optimal training tokens, 20 per parameter.

    Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models", Sec. 3 and Table 3:
    parameters and tokens should grow in equal proportion, about 20 tokens per parameter;
    Chinchilla itself (Sec. 4) is 70B parameters trained on 1.4T tokens.
    """
    if n_params <= 0:
        raise ValueError(f"parameters must be > 0, got {n_params!r}")
    return TOKENS_PER_PARAM * n_params


def training_energy_j(days: float, devices: int, watts_per_device: float, pue: float = 1.0) -> float:
    """Joules: training time x devices x average power per device x PUE.

    Patterson et al. 2021, "Carbon Emissions and Large Neural Network Training", Table 4, whose
    rows follow this product (GPT-3: 10,000 V100s, 14.8 days, 330 W average per processor, PUE 1.1:
    1,287 MWh).
    PUE (power usage effectiveness) is the datacenter's energy over its IT equipment's, >= 1.
    """
    if min(days, devices, watts_per_device) <= 0:
        raise ValueError("days, devices and watts per device must all be > 0")
    if pue < 1:
        raise ValueError(f"PUE is facility over IT energy, so >= 1; got {pue!r}")
    return days * 86400 * devices * watts_per_device * pue


def chinchilla_energy_j(n_params: float, peak_flops: float, mfu: float, watts_per_device: float,
                        pue: float = 1.0, flops_per_param_token: float = 6) -> float:
    """Joules to train `n_params` on `chinchilla_tokens(n_params)` at `mfu` of each device's peak.

    `flops.training_days` on one device, then `training_energy_j`: at a fixed MFU the energy does
    not depend on how many devices share the work. With 6 N D FLOPs (Kaplan et al. 2020, Sec. 2.1)
    it is 120 N^2 / (peak x MFU) device-seconds: the deck's ~P^2.
    """
    days = training_days(n_params, chinchilla_tokens(n_params), 1, peak_flops, mfu, flops_per_param_token)
    return training_energy_j(days, 1, watts_per_device, pue)
