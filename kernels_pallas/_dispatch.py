"""One dispatch helper for every op in ``kernels_pallas``: which implementations an op has, where each
runs, and how ``implementation=`` is turned into one of them.

Implementation names mean the same thing in every op:

  "reference"      the op's definition in plain jnp (``<op>/reference.py``), differentiated by
                   autodiff; the oracle of the tests, runs everywhere, never the fast path.
  "xla"            a hand-written XLA implementation with its own ``jax.custom_vjp`` (chunked, or saving
                   fewer residuals); runs everywhere.
  "xla_fp8"        an XLA implementation whose GEMMs take FP8 operands (fp8_matmul): cuBLASLt's FP8 GEMMs on
                   GPUs of compute capability 8.9+; elsewhere XLA upcasts them (a test vehicle on the CPU).
  "pallas"         Pallas kernels on the Triton backend (NVIDIA GPUs); off the GPU the same kernels run
                   in interpret mode, which is a test vehicle, so ``supported_on`` says False there.
  "pallas_mosaic"  Pallas kernels on the Mosaic GPU backend (Hopper wgmma/TMA; grouped_matmul); off the GPU
                   they run in Mosaic GPU's interpreter, a test vehicle like "pallas"'s.
  "cudnn"          cuDNN's fused kernels through XLA (NVIDIA GPUs only).

``None`` and ``"auto"`` ask the op to choose: ``Op.resolve`` takes the first implementation of the op's
``auto_order`` that is ``supported_on`` the device (an op may refine that per call, as attention does from
its measured table).  An explicit name is honoured wherever it can run (``runs_on``: natively, or in
interpret mode); anything else is one ``ValueError`` line naming the op, the request and the choices.

An op may keep an old spelling as an alias (attention's ``"xla"`` meant its reference before these names
were fixed, and ``TrainConfig.attention_implementation`` still accepts it); aliases resolve to the
canonical name before anything else happens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax

AUTO = "auto"
GPU_PLATFORMS = ("gpu", "cuda")
ALL_PLATFORMS = ("cpu", "gpu", "cuda", "tpu")


def target_platform() -> str:
    """The platform a program is being built for when no device is named: the device of the mesh set for tracing
    (`jax.set_mesh`, as `jaxft.sharding.Placement.tracing` does), else ``jax_default_device``, else the first
    device. An ahead-of-time compile for a GPU target on a CPU-only host (``experiments/deviceless``) traces under
    the target's mesh, so its Pallas kernels lower for that GPU, not for the CPU's interpreter."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None:
        return abstract.platform
    chosen = jax.config.jax_default_device
    if isinstance(chosen, jax.Device):
        return chosen.platform
    return chosen if isinstance(chosen, str) else jax.devices()[0].platform


def _platform(device) -> str:
    """Platform name of a ``jax.Device`` or of a platform string ("cpu", "gpu"); None: the default device."""
    if device is None:
        return target_platform()
    return device if isinstance(device, str) else device.platform


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way of computing an op.

    ``platforms``: where it runs natively (and may be picked by ``auto``).  ``interpret_platforms``: where
    it can still be asked for by name because it runs in an interpreter there (Pallas on CPU).
    ``device_check``: a further condition on a device of those platforms (e.g. a compute capability), given
    the ``jax.Device``, or for a platform name the default device when it is of that platform.
    ``fn`` is the callable the op's api invokes; its signature is the op's business.
    """

    name: str
    fn: Callable
    platforms: tuple[str, ...]
    interpret_platforms: tuple[str, ...] = ()
    summary: str = ""
    device_check: Callable | None = None

    def supported_on(self, device=None) -> bool:
        """True iff this implementation runs natively on ``device`` (a ``jax.Device`` or platform name)."""
        if _platform(device) not in self.platforms:
            return False
        if self.device_check is None:
            return True
        if device is None or isinstance(device, str):
            device = jax.devices()[0]
            if _platform(device) not in self.platforms:
                return False
        return bool(self.device_check(device))

    def runs_on(self, device=None) -> bool:
        """True iff it can run on ``device`` at all: natively or in interpret mode."""
        return self.supported_on(device) or _platform(device) in self.interpret_platforms


@dataclasses.dataclass(frozen=True)
class Op:
    """The registry of one op: its implementations by name, ``auto``'s order of preference, aliases.

    ``where`` (file and function of the public entry point) starts every error message.
    """

    name: str
    where: str
    implementations: tuple[Implementation, ...]
    auto_order: tuple[str, ...]
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        names = self.names
        if len(set(names)) != len(names) or AUTO in names:
            raise ValueError(f"{self.where}: op {self.name!r} has duplicate or reserved implementation names {names}.")
        for n in tuple(self.auto_order) + tuple(self.aliases.values()):
            if n not in names:
                raise ValueError(f"{self.where}: op {self.name!r} refers to unknown implementation {n!r}.")

    @property
    def names(self) -> tuple[str, ...]:
        """Canonical implementation names, in registration order."""
        return tuple(i.name for i in self.implementations)

    @property
    def accepted(self) -> tuple[str, ...]:
        """Every spelling ``implementation=`` accepts: names, aliases, ``"auto"`` (and None)."""
        return self.names + tuple(self.aliases) + (AUTO,)

    def get(self, name: str) -> Implementation:
        """The implementation registered under ``name`` (canonical or alias)."""
        canonical = self.canonical(name)
        return next(i for i in self.implementations if i.name == canonical)

    def canonical(self, name: str | None) -> str:
        """Validate a requested name and map aliases; ``None`` becomes ``"auto"``."""
        if name is None:
            return AUTO
        if not isinstance(name, str) or name not in self.accepted:
            raise ValueError(
                f"{self.where}: {self.name} has no implementation={name!r}; use one of "
                f"{self.accepted} (or None for auto)."
            )
        return self.aliases.get(name, name)

    def supported_on(self, name: str, device=None) -> bool:
        return self.get(name).supported_on(device)

    def available_on(self, device=None) -> tuple[str, ...]:
        """Names of the implementations that run natively on ``device``."""
        return tuple(i.name for i in self.implementations if i.supported_on(device))

    def default_for(self, device=None) -> str:
        """``auto``'s device-level choice: the first of ``auto_order`` supported on ``device``."""
        for n in self.auto_order:
            if self.get(n).supported_on(device):
                return n
        raise ValueError(
            f"{self.where}: {self.name} has no implementation for platform {_platform(device)!r} "
            f"(auto order {self.auto_order})."
        )

    def resolve(self, name: str | None, device=None) -> Implementation:
        """Turn ``implementation=`` (None, "auto", a name or an alias) into a concrete implementation.

        An explicit name must be able to run on ``device`` (``runs_on``); otherwise the error names the
        op, the request, the device's platform and what runs there.
        """
        canonical = self.canonical(name)
        if canonical == AUTO:
            return self.get(self.default_for(device))
        impl = self.get(canonical)
        if not impl.runs_on(device):
            here = tuple(i.name for i in self.implementations if i.runs_on(device))
            raise ValueError(
                f"{self.where}: {self.name} implementation={name!r} does not run on platform "
                f"{_platform(device)!r}; there use one of {here} or 'auto'."
            )
        return impl


def reference_and_xla(name: str, where: str, reference: Callable, xla: Callable, xla_summary: str) -> Op:
    """The registry of an op whose implementations are its definition ("reference", plain autodiff) and one
    portable custom-VJP version ("xla", preferred by "auto"): the norms, the GLUs, the 4-bit matmul."""
    return Op(name=name, where=where,
              implementations=(Implementation("reference", reference, ALL_PLATFORMS,
                                              summary="autodiff of the definition"),
                               Implementation("xla", xla, ALL_PLATFORMS, summary=xla_summary)),
              auto_order=("xla", "reference"))
