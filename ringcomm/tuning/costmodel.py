"""An alpha-beta-gamma cost model of the collectives (pure: stdlib and NumPy, layer 0).

A world is ``H`` hosts of ``L`` ranks each, ranks numbered host by host. Two link classes:
``local`` (same host: every rank its own link) and ``net`` (one full-duplex uplink per host,
shared by its ranks). A message costs ``alpha_s``, a byte ``beta_s_per_byte`` on the
busiest link, a reduced byte ``gamma_s_per_byte`` on the busiest rank, a call
``overhead_s``; a model from ``ringcomm tune --hostfile`` adds the CPU its ranks share.
Nothing here runs a collective: a group with a model (:func:`load_tune_file`,
``RINGCOMM_TUNE_FILE``) chooses its algorithms and piece sizes by :func:`predict` through
:mod:`ringcomm.collectives.choice`.

Here: the public names of :mod:`~ringcomm.tuning.parameters` (the model, its JSON),
:mod:`~ringcomm.tuning.plans` (algorithms as data), :mod:`~ringcomm.tuning.pricing` and
:mod:`~ringcomm.tuning.fitting`; docs/architecture.md ("The cost model") has the details.
"""

from __future__ import annotations

from ringcomm.config import DEFAULT_CHUNK_BYTES
from ringcomm.tuning.fitting import (
    FIT_PARAMETERS,
    HOST_FIT_PARAMETERS,
    ROBUST_SCALE,
    Fit,
    HostFit,
    HostSample,
    Sample,
    design_row,
    fit_hosts,
    fit_local,
    predict_sample,
)
from ringcomm.tuning.parameters import (
    ALGORITHMS,
    FORMAT_VERSION,
    HIER_SEGMENT_BYTES,
    OPS,
    READ_VERSIONS,
    CostModel,
    CpuModel,
    LinkModel,
    busbw_factor,
    load_tune_file,
)
from ringcomm.tuning.plans import PROBE_KINDS, Load, Plan, Step, plan, probe_plan
from ringcomm.tuning.pricing import (
    Crossover,
    Prediction,
    best,
    crossovers,
    plan_time,
    predict,
    uplink_bytes,
)

__all__ = [
    "ALGORITHMS",
    "DEFAULT_CHUNK_BYTES",
    "FIT_PARAMETERS",
    "FORMAT_VERSION",
    "HIER_SEGMENT_BYTES",
    "HOST_FIT_PARAMETERS",
    "OPS",
    "PROBE_KINDS",
    "READ_VERSIONS",
    "ROBUST_SCALE",
    "CostModel",
    "CpuModel",
    "Crossover",
    "Fit",
    "HostFit",
    "HostSample",
    "LinkModel",
    "Load",
    "Plan",
    "Prediction",
    "Sample",
    "Step",
    "best",
    "busbw_factor",
    "crossovers",
    "design_row",
    "fit_hosts",
    "fit_local",
    "load_tune_file",
    "plan",
    "plan_time",
    "predict",
    "predict_sample",
    "probe_plan",
    "uplink_bytes",
]
