"""torch.profiler traces of the engine's steps (SGLang's /start_profile and /stop_profile).

Start and stop are asked for from the gRPC threads but carried out by the engine thread at a step
boundary (`on_step`), because the profiler records the thread that runs the model: a trace begins
and ends between two steps, never inside one. A trace stops by itself after `num_steps` steps, or at
`stop`. The file is a Chrome trace (`*.pt.trace.json`), what torch.profiler's tooling (TensorBoard's
profiler plugin, Perfetto, chrome://tracing) opens.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ringserve.errors import FailedPrecondition, InvalidArgument, ServiceError

log = logging.getLogger(__name__)

ACTIVITIES = {"CPU": ProfilerActivity.CPU, "GPU": ProfilerActivity.CUDA, "CUDA": ProfilerActivity.CUDA}
DEFAULT_DIR = Path(tempfile.gettempdir()) / "ringserve-profile"  # when the caller names no output_dir
COMMAND_TIMEOUT_S = 60.0  # a step (and so a start or stop) never takes this long


class ProfileError(FailedPrecondition):
    """A start or stop that cannot be done now (already profiling, not profiling)."""


@dataclass
class ProfileOptions:
    output_dir: str = ""
    num_steps: int | None = None
    activities: list[str] = field(default_factory=list)
    with_stack: bool = False
    record_shapes: bool = False
    profile_prefix: str = ""


@dataclass
class _Command:
    start: ProfileOptions | None  # None: stop
    done: threading.Event = field(default_factory=threading.Event)
    files: list[str] = field(default_factory=list)
    error: str = ""


class StepProfiler:
    def __init__(self, name: str = "scheduler") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._pending: _Command | None = None
        self._prof: profile | None = None
        self._opts = ProfileOptions()
        self._steps = 0
        self.last_files: list[str] = []   # of the last trace written (also after a num_steps stop)

    @property
    def pending(self) -> bool:
        return self._pending is not None

    @property
    def active(self) -> bool:
        return self._prof is not None

    # -- any thread ------------------------------------------------------------------------------

    def validate(self, opts: ProfileOptions) -> ProfileOptions:
        acts = [a.upper() for a in opts.activities] or ["CPU", "GPU"]
        unknown = [a for a in acts if a not in ACTIVITIES]
        if unknown:
            raise InvalidArgument("activities", f"{unknown} not supported (CPU, GPU)")
        if opts.num_steps is not None and opts.num_steps <= 0:
            raise InvalidArgument("num_steps", "must be positive")
        if not torch.cuda.is_available():
            acts = [a for a in acts if a == "CPU"]
        if not acts:
            raise InvalidArgument("activities", "GPU asked for, but this scheduler has no CUDA device")
        out = opts.output_dir or str(DEFAULT_DIR)
        return ProfileOptions(out, opts.num_steps, acts, opts.with_stack, opts.record_shapes, opts.profile_prefix)

    def request(self, start: ProfileOptions | None, wake: Callable[[], None]) -> list[str]:
        """Ask the engine thread to start (opts) or stop (None) and wait until it did; returns the
        files a stop wrote. Raises ProfileError when refused."""
        cmd = _Command(start)
        with self._lock:
            if self._pending is not None:
                raise ProfileError("a profile start or stop is already in progress")
            if start is not None and self._prof is not None:
                raise ProfileError("already profiling; stop the current profile first")
            if start is None and self._prof is None:
                if not self.last_files:
                    raise ProfileError("not profiling")
                files, self.last_files = self.last_files, []  # it stopped by itself (num_steps)
                return files
            self._pending = cmd
        wake()
        if not cmd.done.wait(COMMAND_TIMEOUT_S):
            with self._lock:
                if self._pending is cmd:
                    self._pending = None
            raise ProfileError("the engine did not reach a step boundary in time")
        if cmd.error:
            raise ServiceError(cmd.error)
        return cmd.files

    # -- the engine thread -----------------------------------------------------------------------

    def on_step(self, stepped: bool) -> None:
        """At a step boundary: apply a pending start or stop; count a step that ran a batch."""
        if self._prof is not None and stepped:
            self._steps += 1
            self._prof.step()
            if self._opts.num_steps is not None and self._steps >= self._opts.num_steps:
                self.last_files = self._finish()
        cmd = self._pending
        if cmd is None:
            return
        try:
            if cmd.start is not None:
                self._begin(cmd.start)
            else:
                # It may have stopped by itself (num_steps) since the request was checked.
                cmd.files = self._finish() if self._prof is not None else list(self.last_files)
        except (OSError, RuntimeError) as e:
            cmd.error = f"profiler: {e}"
            self._prof = None
        with self._lock:
            self._pending = None
        cmd.done.set()

    def _begin(self, opts: ProfileOptions) -> None:
        Path(opts.output_dir).mkdir(parents=True, exist_ok=True)
        prof = profile(activities=[ACTIVITIES[a] for a in opts.activities], record_shapes=opts.record_shapes,
                       with_stack=opts.with_stack)
        prof.start()
        self._prof, self._opts, self._steps, self.last_files = prof, opts, 0, []
        log.info("profiling started: %s, %s steps, to %s", "+".join(opts.activities),
                 opts.num_steps if opts.num_steps is not None else "until stopped", opts.output_dir)

    def _finish(self) -> list[str]:
        prof, self._prof = self._prof, None
        assert prof is not None
        prof.stop()
        name = f"{self._opts.profile_prefix}{int(time.time() * 1000)}-{self.name}-{os.getpid()}.pt.trace.json"
        path = str(Path(self._opts.output_dir) / name)
        prof.export_chrome_trace(path)
        log.info("profiling stopped after %d steps: %s", self._steps, path)
        return [path]
