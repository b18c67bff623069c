"""Several processes, one run: `jax.distributed` from the `distributed:` key, and who writes what.

A run over several hosts (or several processes on one host) is P copies of `jaxft-train`, one per process,
that JAX's distributed runtime joins into one set of devices (`jax.devices()` lists every process's devices,
`jax.local_devices()` this process's). It must be joined before anything touches a device, so
`jaxft.train.train` calls `initialize` first.

The `distributed` key (`DistributedConfig.from_value`):
    null      (default) one process, unless the launcher set JAXFT_NUM_PROCESSES (with JAXFT_COORDINATOR and
              JAXFT_PROCESS_ID): then those, as if given explicitly
    off       one process, whatever the environment says
    auto      JAX's own detection of the cluster (SLURM: SLURM_JOB_ID & co, Open MPI: OMPI_COMM_WORLD_*),
              joined only when that environment says more than one process. JAX then runs ONE PROCESS PER
              DEVICE (it takes SLURM_LOCALID / OMPI_COMM_WORLD_LOCAL_RANK as the one local device)
    {coordinator_address: HOST:PORT, num_processes: P, process_id: I}
              explicit; a key left out is read from JAXFT_COORDINATOR / JAXFT_NUM_PROCESSES / JAXFT_PROCESS_ID.
              Each process uses every device it can see (one process per host: scripts/slurm_train.sh)

CPU: JAX 0.11's CPU client does cross-process collectives with gloo (`jax_cpu_collectives_implementation`,
default "gloo"), so P processes of host devices train together exactly as one process with all the devices
(tests/test_multiprocess.py).

Who writes what: every process computes every step, takes part in every collective (checkpoints: orbax
writes each process's shards and process 0 the metadata; the merged export's gathers), and only process 0
(`is_main_process`) writes files of its own: metrics.jsonl, TensorBoard, the loss curve, the adapter, the
merged model, train_config.json and the output_dir lock.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Any, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxft.errors import ConfigError

logger = logging.getLogger("jaxft.train")

MODES = ("off", "auto", "explicit")
ENV = {"coordinator_address": "JAXFT_COORDINATOR", "num_processes": "JAXFT_NUM_PROCESSES",
       "process_id": "JAXFT_PROCESS_ID"}
KEYS = tuple(ENV)
_ADDRESS = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:(\d{1,5})$")


class DistributedConfigError(ConfigError):
    """A bad `distributed` setting (or JAXFT_* environment variable); `field` is "distributed"."""

    def __init__(self, problem: str):
        self.field, self.problem = "distributed", problem
        super().__init__(f"key 'distributed': {problem}")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins the others (see the module docstring). `explicit` needs all three values."""

    mode: str = "off"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise DistributedConfigError(f"mode {self.mode!r} is not one of {', '.join(map(repr, MODES))}")
        given = [k for k in KEYS if getattr(self, k) is not None]
        if self.mode != "explicit":
            if given:
                raise DistributedConfigError(f"{given[0]} is only read by the explicit form; write distributed: "
                                             "{coordinator_address: HOST:PORT, num_processes: P, process_id: I}")
            return
        for key in KEYS:
            if getattr(self, key) is None:
                raise DistributedConfigError(f"{key} is missing; give it in the mapping or set {ENV[key]} in the "
                                             "environment")
        n, i, address = self.num_processes, self.process_id, self.coordinator_address
        for key, value in (("num_processes", n), ("process_id", i)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise DistributedConfigError(f"{key}={value!r} must be an integer")
        if n < 1:
            raise DistributedConfigError(f"num_processes={n} must be >= 1")
        if not 0 <= i < n:
            raise DistributedConfigError(f"process_id={i} must be in [0, {n - 1}] (num_processes={n})")
        match = _ADDRESS.match(address) if isinstance(address, str) else None
        if match is None or not 0 < int(match.group(1)) < 65536:
            raise DistributedConfigError(f"coordinator_address={address!r} must be HOST:PORT (e.g. node001:12345), "
                                         "the address of process 0")

    @classmethod
    def from_value(cls, value: Any, environ: Mapping[str, str] | None = None) -> "DistributedConfig":
        """From the `distributed:` value of a config (None / "off" / "auto" / a mapping) and the environment."""
        env = os.environ if environ is None else environ
        if isinstance(value, DistributedConfig):
            return value
        if value is None:
            if ENV["num_processes"] not in env:
                return cls()
            return cls._explicit({}, env)
        if value is False or value == "off":
            return cls()
        if value == "auto":
            return cls(mode="auto")
        if isinstance(value, Mapping):
            unknown = [k for k in value if k not in KEYS]
            if unknown:
                raise DistributedConfigError(f"unknown key {unknown[0]!r}; the keys are {', '.join(KEYS)}")
            return cls._explicit(value, env)
        raise DistributedConfigError(f"value {value!r} must be null, off, auto or a mapping {{coordinator_address: "
                                     "HOST:PORT, num_processes: P, process_id: I}")

    @classmethod
    def _explicit(cls, values: Mapping[str, Any], env: Mapping[str, str]) -> "DistributedConfig":
        out = dict(values)
        for key, var in ENV.items():
            if out.get(key) is None and var in env:
                text = env[var].strip()
                if key == "coordinator_address":
                    out[key] = text
                else:
                    try:
                        out[key] = int(text)
                    except ValueError:
                        raise DistributedConfigError(f"environment variable {var}={env[var]!r} must be an integer"
                                                     ) from None
        return cls(mode="explicit", **out)

    def describe(self) -> str:
        if self.mode == "explicit":
            return (f"process {self.process_id} of {self.num_processes}, coordinator {self.coordinator_address}")
        return self.mode


def _cluster_process_count(env: Mapping[str, str]) -> tuple[str, int] | None:
    """(launcher, process count) when a SLURM job step or Open MPI launch is seen in `env`, else None."""
    if "SLURM_JOB_ID" in env and "SLURM_NTASKS" in env and "SLURM_PROCID" in env:
        return "SLURM", int(env["SLURM_NTASKS"])
    if "OMPI_COMM_WORLD_SIZE" in env:
        return "Open MPI", int(env["OMPI_COMM_WORLD_SIZE"])
    return None


def initialize(config: DistributedConfig, environ: Mapping[str, str] | None = None) -> bool:
    """Joins the processes `config` describes (`jax.distributed.initialize`); True when this is a multi-process
    run. A no-op when already joined, for one process, and in `auto` mode outside a multi-process launch.
    Must run before any device is used (JAX refuses later: the error says so)."""
    env = os.environ if environ is None else environ
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    if config.mode == "off":
        return False
    if config.mode == "auto":
        found = _cluster_process_count(env)
        if found is None or found[1] <= 1:
            logger.info("distributed auto: %s; one process", "a single-task launch" if found else
                        "no SLURM / Open MPI launch in the environment")
            return False
        jax.distributed.initialize()
    else:
        if config.num_processes == 1:
            return False
        # 'deactivate': JAX's cluster detection would otherwise pick one local device per process under SLURM.
        jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id,
                                   cluster_detection_method="deactivate")
    logger.info("distributed: process %d of %d, %d local devices of %d", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())
    return True


def is_main_process() -> bool:
    """Whether this process writes the run's own files (metrics, exports): process 0."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """Waits until every process reached the same `name` (no-op for one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def any_process(flag: bool) -> bool:
    """Whether `flag` is true on any process (a collective: every process must call it at the same point)."""
    if jax.process_count() == 1:
        return bool(flag)

    return bool(np.any(multihost_utils.process_allgather(np.int32(bool(flag)))))
