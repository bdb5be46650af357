"""The launchers' conventions: which variables name a process's rank, world size and store.

Pure: reads only the mapping it is given, never the process's environment. Each lookup
returns a :class:`Found` (the value and the variable or argument it came from), so an error
names the variable, its value and the convention; :mod:`ringcomm.config` resolves an
``InitConfig`` with these. Also here: Slurm's compressed host lists and the store ports
every rank of a Slurm or Open MPI job derives alike from the job's id.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from ringcomm.errors import RendezvousError

__all__ = [
    "CONVENTIONS",
    "DEFAULT_MASTER_ADDR",
    "MPIRUN_JOB_ID_VARS",
    "SOURCE_ORDER",
    "Found",
    "as_int",
    "env_setting",
    "explicit",
    "lookup",
    "mpirun_defaults",
    "mpirun_job_id",
    "mpirun_master_port",
    "origin",
    "parse_bool",
    "parse_slurm_nodelist",
    "slurm_defaults",
    "slurm_master_port",
]

#: Where a group of more than one process looks for the store when no address is given.
DEFAULT_MASTER_ADDR = "127.0.0.1"

#: The launcher conventions in precedence order: (source name, human label, variable names).
#: A variable name of None means the convention does not define that setting.
CONVENTIONS: tuple[tuple[str, str, dict[str, str | None]], ...] = (
    (
        "ringcomm",
        "RINGCOMM_* variables",
        {
            "rank": "RINGCOMM_RANK",
            "world_size": "RINGCOMM_WORLD_SIZE",
            "local_rank": "RINGCOMM_LOCAL_RANK",
            "local_world_size": "RINGCOMM_LOCAL_WORLD_SIZE",
            "master_addr": "RINGCOMM_MASTER_ADDR",
            "master_port": "RINGCOMM_MASTER_PORT",
        },
    ),
    (
        "torchrun",
        "torchrun variables",
        {
            "rank": "RANK",
            "world_size": "WORLD_SIZE",
            "local_rank": "LOCAL_RANK",
            "local_world_size": "LOCAL_WORLD_SIZE",
            "master_addr": "MASTER_ADDR",
            "master_port": "MASTER_PORT",
        },
    ),
    (
        "mpirun",
        "mpirun variables",
        {
            "rank": "OMPI_COMM_WORLD_RANK",
            "world_size": "OMPI_COMM_WORLD_SIZE",
            "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
            "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
            "master_addr": None,
            "master_port": None,
        },
    ),
    (
        "pmi",
        "PMI variables",
        {
            "rank": "PMI_RANK",
            "world_size": "PMI_SIZE",
            "local_rank": "MPI_LOCALRANKID",
            "local_world_size": "MPI_LOCALNRANKS",
            "master_addr": None,
            "master_port": None,
        },
    ),
    (
        "slurm",
        "Slurm variables",
        {
            "rank": "SLURM_PROCID",
            "world_size": "SLURM_NTASKS",
            "local_rank": "SLURM_LOCALID",
            "local_world_size": None,
            "master_addr": None,
            "master_port": None,
        },
    ),
)
#: Every source of a setting, highest precedence first.
SOURCE_ORDER = ("explicit", *(c[0] for c in CONVENTIONS), "singleton")

_SLURM_PORT_BASE = 20000
_SLURM_PORT_SPAN = 40000  # derived ports fall in 20000..59999
# mpirun's derived ports fall in 61000..65535: above Linux's default ephemeral range
# (32768..60999), so no outgoing connection holds one by chance.
_MPIRUN_PORT_BASE = 61000
_MPIRUN_PORT_SPAN = 4536
#: Where Open MPI names its job, read in this order (the first set one wins): PMIx's
#: namespace (Open MPI 4 and 5), then the ORTE job id (4.x: ``ess_base_jobid``; older
#: releases ``orte_ess_jobid``). Every rank of one ``mpirun`` sees the same value.
MPIRUN_JOB_ID_VARS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid")


@dataclass(frozen=True)
class Found:
    """One resolved setting and where it came from (for error messages)."""

    value: str | int | float | bool
    name: str  # variable or argument name, e.g. "RANK" or "rank"
    source: str  # "explicit", "ringcomm", "torchrun", ..., or "default"
    label: str  # e.g. "torchrun variables"

    def describe(self) -> str:
        """``RANK=5``: the name and the value as the user wrote it."""
        return f"{self.name}={self.value}"


def lookup(env: Mapping[str, str], setting: str) -> Found | None:
    """The first launcher convention that sets ``setting`` (empty values count as unset)."""
    for source, label, names in CONVENTIONS:
        name = names[setting]
        if name is None:
            continue
        raw = env.get(name)
        if raw is not None and raw.strip():
            return Found(raw.strip(), name, source, label)
    return None


def as_int(found: Found) -> int:
    """The setting as an int; strings must be plain decimal integers."""
    value = found.value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value):
        return int(value)
    raise RendezvousError(f"{found.name}={value!r} is not an integer (from {found.label})")


def explicit(name: str, value: str | float | None) -> Found | None:
    """An argument the caller passed (None: not passed)."""
    if value is None:
        return None
    return Found(value, name, "explicit", "explicit argument")


def env_setting(env: Mapping[str, str], name: str) -> Found | None:
    """Variable ``name`` of ``env``, stripped; None when unset or blank."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    return Found(raw.strip(), name, "ringcomm", "environment")


def parse_bool(found: Found) -> bool:
    """1/true/yes/on or 0/false/no/off (any case); anything else raises."""
    text = str(found.value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise RendezvousError(f"{found.describe()} is not a boolean (use 1/0, true/false)")


def origin(*found: Found | None) -> str:
    """``"(from torchrun variables)"``, or one clause per setting when sources differ."""
    present = [f for f in found if f is not None]
    labels = {f.label for f in present}
    if len(labels) == 1:
        return f"(from {labels.pop()})"
    return "(" + ", ".join(f"{f.name} from {f.label}" for f in present) + ")"


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"invalid Slurm host list {text!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"invalid Slurm host list {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"invalid Slurm host list {text!r}: unbalanced '['")
    parts.append(text[start:])
    return parts


def _expand_bracket(body: str, whole: str) -> list[str]:
    """Expand the inside of one ``[...]``: ``"01-03,07"`` -> ``["01", "02", "03", "07"]``."""
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"invalid Slurm host list {whole!r}: bad range {item!r}")
        if not sep:
            out.append(lo)
            continue
        first, last = int(lo), int(hi)
        if last < first:
            raise ValueError(f"invalid Slurm host list {whole!r}: descending range {item!r}")
        width = len(lo)  # Slurm keeps the zero padding of the range's first bound
        out.extend(f"{n:0{width}d}" for n in range(first, last + 1))
    return out


def parse_slurm_nodelist(text: str) -> list[str]:
    """Expand a Slurm compressed host list, in Slurm's order, zero padding kept.

    ``"node[01-03,07],gpu5,a[1-2]b"`` ->
    ``["node01", "node02", "node03", "node07", "gpu5", "a1b", "a2b"]``; several bracket
    groups in one name expand as a product (``"r[1-2]n[1-2]"`` -> r1n1, r1n2, r2n1, r2n2).
    Malformed lists raise :class:`ValueError`.
    """
    hosts: list[str] = []
    for part in _split_top_level(text.strip()):
        part = part.strip()
        if not part:
            continue
        names = [""]
        for piece in re.split(r"(\[[^\]]*\])", part):
            choices = _expand_bracket(piece[1:-1], text) if piece.startswith("[") else [piece]
            names = [name + choice for name in names for choice in choices]
        hosts.extend(names)
    return hosts


def slurm_master_port(job_id: int) -> int:
    """The store port every rank of Slurm job ``job_id`` agrees on: 20000 + id % 40000."""
    return _SLURM_PORT_BASE + job_id % _SLURM_PORT_SPAN


def mpirun_job_id(env: Mapping[str, str]) -> tuple[str, str] | None:
    """``(variable, value)`` naming this Open MPI job (:data:`MPIRUN_JOB_ID_VARS`), or None."""
    for name in MPIRUN_JOB_ID_VARS:
        value = (env.get(name) or "").strip()
        if value:
            return name, value
    return None


def mpirun_master_port(job_id: str) -> int:
    """The store port every rank of Open MPI job ``job_id`` agrees on:
    61000 + crc32(job_id) % 4536 (61000..65535; a stable hash, the same in every process)."""
    return _MPIRUN_PORT_BASE + zlib.crc32(job_id.encode()) % _MPIRUN_PORT_SPAN


def mpirun_defaults(env: Mapping[str, str], world: int) -> tuple[int | None, str | None, str]:
    """A port for an mpirun job whose ranks all run on this host: ``(port, origin, "")``;
    else ``(None, None, why)``, ``why`` completing the "no store port" error."""
    local = (env.get("OMPI_COMM_WORLD_LOCAL_SIZE") or "").strip()
    if local != str(world):
        why = (
            f"The ranks span hosts (OMPI_COMM_WORLD_LOCAL_SIZE={local}, "
            f"OMPI_COMM_WORLD_SIZE={world})"
            if local
            else "Without OMPI_COMM_WORLD_LOCAL_SIZE the ranks may span hosts"
        )
        return (
            None,
            None,
            (
                f". {why}: export rank 0's host and a free port to every rank, "
                "mpirun -x MASTER_ADDR=<host> -x MASTER_PORT=<port>"
            ),
        )
    job = mpirun_job_id(env)
    if job is None:
        names = ", ".join(MPIRUN_JOB_ID_VARS)
        return None, None, f" (mpirun set none of {names} to derive one from)"
    name, value = job
    return mpirun_master_port(value), f"derived from Open MPI's job id ({name}={value})", ""


def slurm_defaults(
    env: Mapping[str, str], addr: str | None, port: int | None
) -> tuple[str | None, int | None, str | None]:
    """Fill a missing address/port from the Slurm job: first node, port from the job id;
    ``(addr, port, where the port came from or None)``."""
    if addr is None:
        nodelist = (env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "").strip()
        if nodelist:
            try:
                hosts = parse_slurm_nodelist(nodelist)
            except ValueError as exc:
                raise RendezvousError(f"SLURM_JOB_NODELIST: {exc}") from None
            addr = hosts[0] if hosts else None
    port_origin = None
    if port is None:
        job_id = (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "").strip()
        if job_id:
            if not job_id.isdigit():
                raise RendezvousError(f"SLURM_JOB_ID={job_id!r} is not an integer")
            port = slurm_master_port(int(job_id))
            port_origin = f"derived from the Slurm job id (SLURM_JOB_ID={job_id})"
    return addr, port, port_origin
