"""Checkpoints: tensors in safetensors, everything else in JSON, written sharded and (by default) asynchronously.

Layout of `checkpoints/step-NNNNNN/`:

- `state/shard-0000R-*.safetensors`: the trainer's tensors as written by `torch.distributed.checkpoint` (DCP) with
  its safetensors storage: each update rank writes its own shard (FSDP: its slice of every parameter and AdamW
  moment; DDP: a share of the replicated tensors, each written once), nothing is gathered to one process. Keys
  are `model.<fqn>` and `optim.<fqn>.<name>`; the sharding (offsets) is in each file's safetensors header, so a
  checkpoint loads into any number of ranks, or one process (DCP reshards on load).
- `model.safetensors`, `config.json`, tokenizer files: the Hugging Face model directory. With one update process
  (`checkpoint.hf_model`, the default) the weights are written here and not in `state/` (they are in that process
  already, so this costs nothing extra); with several ranks `config.json` and the tokenizer are written and
  `model.safetensors` is produced by `export_model` (the run exports its last checkpoint when it finishes).
- `trainer_state.json` + `trainer_state.safetensors`: optimizer param groups, adaptive-LR state, step, policy
  version, data-sampler cursor, ensemble window, evals (no RNG state: seeds are derived from (seed, step)). Tensors and arrays go
  to the safetensors file and appear in the JSON as `{"__tensor__": key}` / `{"__ndarray__": key}`.
- `checkpoint.json`: step, eval pass@1 (the retention score), ranks, bytes.

Nothing is pickled and nothing is unpickled: safetensors and JSON only (DCP's own `.metadata` pickle is not used;
its safetensors reader rebuilds the metadata from the file headers). A pickled `trainer_state.pt` from an older
version is refused, never loaded.

Atomicity: every rank writes into `.step-NNNNNN.partial/`; after the last shard is written (DCP's final collective)
rank 0 writes the JSON files, fsyncs every file and the directory, renames it to `step-NNNNNN/`, fsyncs the parent,
and only then replaces `checkpoints/latest` (a text file naming the directory) atomically. A crash at any moment
leaves `latest` naming the previous complete checkpoint.

Asynchronous save (`AsyncCheckpointer`, `checkpoint.async_save`): one background thread copies the state to host
memory while the next update's forward and backward passes run (the state changes only at its optimizer step,
which waits for the copy), then writes it while training continues; at most one save is in flight (the next one
waits for it); the error of a failed background save is raised by every later wait.

Retention keeps the `keep_last` newest plus the `keep_best` best by their score (checkpoint.json's `eval_pass@1`: the
eval pass@1 the recipe passes, or with a probe set the probe pass@1 of the weights saved, so the collapse guard's
best-probe checkpoint stays), and never removes the one `latest` names or the newest intact one (a newer checkpoint
damaged on its way to disk does not cost the last good one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from forge.errors import DiskFull, StorageError, UserError
from forge.io import (
    FULL,
    atomic_write_text,
    check_safetensors,
    human_bytes,
    read_retrying,
    read_text_retrying,
    safetensors_problem,
)
from forge.model_config import ModelConfig

STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
SHARDS = "state"
WEIGHTS = "model.safetensors"
ADAPTER = "adapter_model.safetensors"  # a LoRA run's checkpoint: peft's adapter file instead of WEIGHTS
ADAPTER_CONFIG = "adapter_config.json"
LEGACY_STATE = "trainer_state.pt"  # pickled by forgeweave before issue 19: refused
PARTIAL = ".partial"
# DCP warns on every single-process save/load that it assumes one process: that is what no_dist asks for
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


# ---------------------------------------------------------------- the JSON + tensors codec


def split_tensors(tree, tensors: dict[str, torch.Tensor], path: str = "s"):
    """`tree` as JSON values; its tensors and numpy arrays go into `tensors` under their path (tuples -> lists)."""
    if isinstance(tree, torch.Tensor):
        tensors[path] = tree.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": path}
    if isinstance(tree, np.ndarray):
        tensors[path] = torch.from_numpy(tree.astype(np.int64) if tree.dtype.kind == "u" else tree.copy())
        return {"__ndarray__": path, "dtype": str(tree.dtype)}
    if isinstance(tree, dict):
        assert all(isinstance(k, str) for k in tree), f"{path}: checkpoint state keys must be strings"
        return {k: split_tensors(v, tensors, f"{path}.{k}") for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [split_tensors(v, tensors, f"{path}.{i}") for i, v in enumerate(tree)]
    assert tree is None or isinstance(tree, (str, int, float, bool)), f"{path}: {type(tree).__name__} is not JSON"
    return tree


def join_tensors(tree, tensors: dict[str, torch.Tensor]):
    """Inverse of `split_tensors` (tuples come back as lists)."""
    if isinstance(tree, dict):
        if "__tensor__" in tree:
            return tensors[tree["__tensor__"]]
        if "__ndarray__" in tree:
            return tensors[tree["__ndarray__"]].numpy().astype(tree["dtype"])
        return {k: join_tensors(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [join_tensors(v, tensors) for v in tree]
    return tree


def encode_state(state: dict) -> tuple[str, dict[str, torch.Tensor]]:
    """`state` as JSON text and copies of its tensors (`split_tensors`): what `trainer_state.*` will hold."""
    tensors: dict[str, torch.Tensor] = {}
    return json.dumps(split_tensors(state, tensors), indent=1) + "\n", tensors


def host_copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CPU copy of a flat tensor dict, DTensor shards included (each keeps its mesh and placements): what an
    asynchronous save writes while training changes the originals."""
    from torch.distributed.tensor import DTensor

    def copy(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            local = t.to_local().detach().to("cpu", copy=True)
            return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                      stride=t.stride())  # fmt: skip
        return t.detach().to("cpu", copy=True)

    return {k: copy(v) for k, v in tensors.items()}


# ---------------------------------------------------------------- what one save writes


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What one rank contributes to checkpoint `step` (host copies for an asynchronous save)."""

    step: int
    shards: dict[str, torch.Tensor]  # this rank's DCP tensors: `model.<fqn>`, `optim.<fqn>.<name>` (DTensor shards)
    weights: dict[str, torch.Tensor] | None  # full HF weights for model.safetensors (one process), else None
    state_json: str  # rank 0: trainer plain state + the loop's payload, as `encode_state` gives them
    state_tensors: dict[str, torch.Tensor]
    eval_score: float | None
    world: int
    weights_file: str = WEIGHTS  # what `weights` is written as: the HF weights, or a LoRA run's ADAPTER


@dataclasses.dataclass(frozen=True)
class SaveReport:
    """A checkpoint that is durable and named by `latest`."""

    step: int
    path: str
    eval_score: float | None
    seconds: float  # from the start of the write to `latest` moved
    bytes: int  # size of the checkpoint directory
    stall_seconds: float = 0.0  # what the trainer's next optimizer step waited for the host copy (asynchronous)


def nonfinite_tensors(tensors: dict[str, torch.Tensor] | None) -> list[str]:
    """Names of the floating-point tensors holding a NaN or inf (a DTensor: this rank's shard)."""
    bad = []
    for name, t in (tensors or {}).items():
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            bad.append(name)
    return bad


def check_finite(snap: Snapshot, root: Path, group=None) -> None:
    """Refuse to write checkpoint `snap.step` if any rank's tensors hold a NaN or inf (a collective over `group`
    with several ranks, so every rank refuses together): `latest` keeps naming the last good checkpoint."""
    bad = nonfinite_tensors(snap.shards) + nonfinite_tensors(snap.weights) + nonfinite_tensors(snap.state_tensors)
    count = len(bad)
    if group is not None:
        flag = torch.tensor([count], dtype=torch.int64)
        torch.distributed.all_reduce(flag, group=group)
        count = int(flag.item())
    if count:
        named = f" (e.g. {bad[0]})" if bad else " (on another rank)"
        raise UserError(
            f"refusing to write checkpoint {step_dir_name(snap.step)} under '{root}': {count} tensor(s) are not "
            f"finite{named}; {root / 'latest'} still names the last good one: lower update.lr and --resume"
        )


def host_snapshot(snap: Snapshot) -> Snapshot:
    """`snap` with host copies of its live tensors (the JSON state's tensors are copies already)."""
    weights = host_copy(snap.weights) if snap.weights is not None else None
    return dataclasses.replace(snap, shards=host_copy(snap.shards), weights=weights)


def begin_checkpoint(root: Path, step: int, rank: int) -> Path:
    """The empty `.step-NNNNNN.partial/` every rank writes into; rank 0 clears a stale one first. No barrier is
    needed: ranks write their shards only after DCP's planning collective, which rank 0 joins after this. Another
    rank's DCP writer makes the (empty) shard directory when it sets up, which may fall between rank 0's rmtree and
    its mkdir (under DDP the other ranks snapshot nothing and get there early: seen once in CI), hence `exist_ok`."""
    tmp = root / f".{step_dir_name(step)}{PARTIAL}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / SHARDS).mkdir(parents=True, exist_ok=True)
    return tmp


def write_model_files(tmp: Path, model, tokenizer) -> None:
    """config.json, generation_config.json and the tokenizer (small; in the foreground: they read live objects);
    a peft model (LoRA) writes its adapter_config.json instead of config.json: the checkpoint is an adapter, and
    `export_model` merges it into the base model."""
    if hasattr(model, "peft_config"):
        model.peft_config[model.active_adapter].save_pretrained(tmp)
    else:
        model.config.save_pretrained(tmp)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The LoRA adapter's tensors as peft saves them (adapter_model.safetensors keys; live tensors)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, save_embedding_layers=False)


def is_adapter(ckpt: Path) -> bool:
    """Whether the checkpoint holds a LoRA adapter (a LoRA run's) rather than the full weights."""
    return (Path(ckpt) / ADAPTER).is_file()


def load_adapter(model, ckpt: Path) -> None:
    """Copy the checkpoint's adapter into peft `model` in place (the optimizer keeps its parameters)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(ckpt) / ADAPTER
    try:
        state = read_retrying(path, lambda: load_file(path))
    except StorageError:  # the storage kept failing the read: not damage
        raise
    except Exception as e:  # missing, truncated or edited file
        raise damaged(ckpt, e) from None
    mismatch = UserError(
        f"checkpoint '{ckpt}': its {ADAPTER} does not match this run's adapter (model.lora.rank or "
        "target_modules changed?): resume with the settings that wrote it"
    )
    if set(state) != set(adapter_state(model)):
        raise mismatch
    try:
        set_peft_model_state_dict(model, state)
    except RuntimeError:  # a tensor of another shape
        raise mismatch from None


def write_checkpoint(snap: Snapshot, tmp: Path, rank: int, group=None) -> SaveReport | None:
    """Collective over `group` (None: one process): every rank writes its shard into `tmp/state`; then rank 0
    writes the rest, makes it durable, renames `tmp` into place and moves `latest`. Returns rank 0's report.
    A full disk (or the file-size limit) on any rank: `tmp` is removed and a `DiskFull` names the directory, the
    space the checkpoint needs and the checkpoint `latest` still names (untouched)."""
    with room_for(snap, tmp):
        return _write_checkpoint(snap, tmp, rank, group)


@contextlib.contextmanager
def room_for(snap: Snapshot, tmp: Path):
    """A full disk (or the file-size limit) met inside the block while checkpoint `snap.step` is written into
    `tmp`: `tmp` is removed and the one-line `checkpoint_full` error raised instead."""
    try:
        yield
    except BaseException as e:  # DCP wraps a rank's OSError in CheckpointException (a BaseException)
        refused = disk_error_in(e)
        if refused is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # give back what was written; nothing else was touched
        raise checkpoint_full(snap, tmp.parent, refused) from None


def disk_error_in(e: BaseException) -> OSError | None:
    """The full-disk / file-size OSError behind `e` (itself, its causes, or a rank's failure DCP gathered)."""
    seen: list[BaseException] = [e]
    for exc in seen:
        if isinstance(exc, OSError) and exc.errno in FULL:
            return exc
        failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        more = [f[0] for f in failures.values()] if isinstance(failures, dict) else []
        seen += [x for x in (*more, exc.__cause__, exc.__context__) if x is not None and x not in seen]
    return None


def checkpoint_full(snap: Snapshot, root: Path, e: OSError) -> DiskFull:
    """The one line for checkpoint `snap.step` that did not fit under `root`: the space it needs (the state's
    size, every rank's shard counted as this rank's) and what `latest` still names."""
    tensors = [*snap.shards.values(), *(snap.weights or {}).values(), *snap.state_tensors.values()]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    need = sum(t.numel() * t.element_size() for t in local) * max(1, snap.world) + len(snap.state_json)
    name = _pointer_name(root / "latest") if (root / "latest").is_file() else None
    kept = f"{root / 'latest'} still names {name}, which is intact" if name and _STEP_DIR.fullmatch(name) and \
        not checkpoint_problem(root / name) else "there is no earlier intact checkpoint"  # fmt: skip
    return DiskFull(
        f"checkpoint {step_dir_name(snap.step)} could not be written under '{root}': {e.strerror or e} (it needs "
        f"about {human_bytes(need)}); {kept}: free space (or raise the file-size limit), then --resume"
    )


def _write_checkpoint(snap: Snapshot, tmp: Path, rank: int, group=None) -> SaveReport | None:
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    write_shards(tmp / SHARDS, snap.shards, group)
    if rank != 0:
        return None
    if snap.weights is not None:
        save_file(snap.weights, tmp / snap.weights_file, metadata={"format": "pt"})
    (tmp / STATE_JSON).write_text(snap.state_json)
    save_file(snap.state_tensors, tmp / STATE_TENSORS)
    size = dir_bytes(tmp)
    info = {"step": snap.step, "eval_pass@1": snap.eval_score, "ranks": snap.world, "bytes": size}
    (tmp / "checkpoint.json").write_text(json.dumps(info, indent=2) + "\n")
    final = tmp.parent / step_dir_name(snap.step)
    commit(tmp, final)
    return SaveReport(snap.step, str(final), snap.eval_score, time.perf_counter() - t0, size + _size(final))


def remove_partial(root: Path) -> list[Path]:
    """Delete `.step-*.partial/` directories (saves that never finished); only while no save is in flight."""
    partial = sorted(p for p in Path(root).glob(f".step-*{PARTIAL}") if p.is_dir())
    for p in partial:
        shutil.rmtree(p, ignore_errors=True)
    return partial


def commit(tmp: Path, final: Path) -> None:
    """fsync every file of `tmp` and `tmp` itself, rename it to `final` (replacing an older one), fsync the parent,
    then point `latest` at it (atomic replace, fsynced)."""
    for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
        _fsync(f)
    for d in sorted((p for p in tmp.rglob("*") if p.is_dir()), reverse=True):
        _fsync(d)
    _fsync(tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync(final.parent)
    atomic_write_text(final.parent / "latest", final.name + "\n")
    _fsync(final.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _size(path: Path) -> int:
    return (path / "checkpoint.json").stat().st_size


# ---------------------------------------------------------------- DCP shards


def write_shards(path: Path, shards: dict[str, torch.Tensor], group=None) -> None:
    """Collective over `group` (None: one process): each rank writes its tensors (fsynced) with DCP's
    safetensors storage."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    writer = HuggingFaceStorageWriter(str(path), save_distributed=True)
    save(shards, storage_writer=writer, process_group=group, no_dist=not _distributed())


def read_shards(ckpt: Path, targets: dict[str, torch.Tensor], group=None) -> None:
    """Collective over `group`: fill `targets` (full tensors or DTensor shards, any layout) in place from the
    checkpoint's shards, whatever the number of ranks that wrote them."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    try:
        load(targets, storage_reader=HuggingFaceStorageReader(str(ckpt / SHARDS)), process_group=group,
             no_dist=not _distributed())  # fmt: skip
    except Exception as e:  # DCP wraps a truncated shard's error in CheckpointException
        raise damaged(ckpt, e) from None


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def shard_keys(ckpt: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The tensors in the checkpoint's shards: key -> (full shape, dtype)."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    if not (ckpt / SHARDS).is_dir():
        return {}
    meta = HuggingFaceStorageReader(str(ckpt / SHARDS)).read_metadata().state_dict_metadata
    return {k: (m.size, m.properties.dtype) for k, m in meta.items()}


def has_weights(ckpt: Path) -> bool:
    """Whether the checkpoint holds an HF `model.safetensors` (else its weights are in the shards)."""
    return (Path(ckpt) / WEIGHTS).is_file()


def export_model(ckpt: Path, out: Path | None = None) -> Path:
    """Write the checkpoint's weights as an HF `model.safetensors` into `out` (default: the checkpoint itself),
    assembled in this process from the shards (or copied, when the checkpoint has the file already); config and
    tokenizer files are copied when `out` is elsewhere. Returns the weights file."""
    from safetensors.torch import save_file

    ckpt, out = Path(ckpt), Path(out or ckpt)
    out.mkdir(parents=True, exist_ok=True)
    if is_adapter(ckpt):
        raise UserError(f"'{ckpt}' holds a LoRA adapter: export it with `forgeweave export RUN OUT` (merges it)")
    if has_weights(ckpt):  # read or copied from here: whole, or one line naming it (never a silent bad copy)
        check_safetensors(ckpt / WEIGHTS, "copy the checkpoint again from a good copy, or export another step")
    if out != ckpt:
        _copy_model_json(ckpt, out)
    if has_weights(ckpt):
        if out != ckpt:
            shutil.copy2(ckpt / WEIGHTS, out / WEIGHTS)
        return out / WEIGHTS
    keys = {k: v for k, v in shard_keys(ckpt).items() if k.startswith("model.")}
    if not keys:
        raise UserError(f"checkpoint '{ckpt}' has no weights to export (no model.safetensors, no state/ shards)")
    targets = {k: torch.empty(size, dtype=dtype) for k, (size, dtype) in keys.items()}
    read_shards(ckpt, targets)
    tmp = out / f".{WEIGHTS}.tmp"
    save_file({k[len("model.") :]: v for k, v in targets.items()}, tmp, metadata={"format": "pt"})
    _fsync(tmp)
    tmp.replace(out / WEIGHTS)
    return out / WEIGHTS


def merged_policy(ckpt: Path, model_cfg: ModelConfig, seed: int):
    """(plain model with the LoRA adapter of checkpoint `ckpt` merged in, tokenizer): the run's `model` section and
    seed rebuild the base model the adapter was trained on."""
    from forge.models import add_lora, load_policy

    base, tok = load_policy(model_cfg, seed=seed)
    model = add_lora(base, model_cfg.lora)
    load_adapter(model, ckpt)
    return model.merge_and_unload(), tok


def export_hf_dir(ckpt: Path, out: Path, model_cfg: ModelConfig | None = None, seed: int = 0) -> Path:
    """Write checkpoint `ckpt` as a clean HF model directory `out` (new, or an empty directory): the weights
    (a LoRA checkpoint's adapter merged into the base model of the run's `model_cfg` and `seed`; a sharded one
    assembled), config, generation config and tokenizer; no trainer state. Assembled in a temporary directory beside `out` and renamed
    into place, so `out` is complete or absent."""
    import tempfile

    ckpt, out = Path(ckpt), Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise UserError(f"export: '{out}' exists and is not an empty directory; choose a new path or remove it")
    if is_adapter(ckpt) and model_cfg is None:
        raise UserError(f"'{ckpt}' holds a LoRA adapter and is not inside its run (no config.yaml two levels up)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if is_adapter(ckpt):
            model, _ = merged_policy(ckpt, model_cfg, seed)
            model.save_pretrained(tmp)
            _copy_model_json(ckpt, tmp, skip=(ADAPTER_CONFIG, "config.json"))
        else:
            export_model(ckpt, tmp)
        for f in sorted(tmp.iterdir()):
            _fsync(f)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
        _fsync(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _copy_model_json(ckpt: Path, out: Path, skip: tuple[str, ...] = ()) -> None:
    """The checkpoint's model files besides the weights (config, generation config, tokenizer files, the chat
    template's .jinja), not its trainer state, shards, adapter or eval report."""
    trainer = {STATE_JSON, STATE_TENSORS, LEGACY_STATE, "checkpoint.json", "eval.json", WEIGHTS, ADAPTER}
    for f in ckpt.iterdir():
        if f.is_file() and f.name not in trainer | set(skip) and not f.name.startswith("."):
            shutil.copy2(f, out / f.name)


# ---------------------------------------------------------------- asynchronous save


class AsyncCheckpointer:
    """At most one save in flight, run by a background thread; `wait` returns its report or raises its error.

    A background save runs `stage` first (the host copy of the state), then `write`. The state does not change
    until the trainer's next optimizer step, so the copy overlaps the next update's forward and backward passes:
    `wait_staged` (called by the optimizer's step pre-hook) blocks until the copy is done, and the seconds it
    blocked are added to the save's `stall_seconds`. A failed save's error is kept: every later `wait` (and so every
    later save) raises it again, so the run fails with it instead of carrying on without checkpoints. `run` does
    the write in the calling thread (a synchronous save)."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._staged = threading.Event()
        self._staged.set()
        self._waited = 0.0  # seconds the trainer waited for the copy of the save in flight
        self._report: SaveReport | None = None
        self._error: BaseException | None = None

    def submit(self, stage: Callable[[], Snapshot], write: Callable[[Snapshot], SaveReport | None]) -> None:
        """Copy (`stage`) then write in the background, once the save in flight (if any) has finished."""
        self.wait()
        self._staged.clear()
        self._waited = 0.0
        self._thread = threading.Thread(target=self._run, args=(stage, write), name="forgeweave-checkpoint",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def run(self, snap: Snapshot, write: Callable[[Snapshot], SaveReport | None]) -> None:
        self.wait()
        self._report = write(snap)

    def wait_staged(self) -> None:
        """Block until the save in flight holds its own copy of the state (the state may change after this)."""
        if not self._staged.is_set():
            t0 = time.perf_counter()
            self._staged.wait()
            self._waited += time.perf_counter() - t0

    def wait(self) -> SaveReport | None:
        """Block until no save is in flight; the last finished save's report (once), or its error (always)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error
        report, self._report = self._report, None
        if report is not None and self._waited:
            report = dataclasses.replace(report, stall_seconds=report.stall_seconds + self._waited)
            self._waited = 0.0
        return report

    def _run(self, stage: Callable[[], Snapshot], write: Callable[[Snapshot], SaveReport | None]) -> None:
        try:
            try:
                snap = stage()
            finally:
                self._staged.set()
            self._report = write(snap)
        except BaseException as e:  # kept for the caller's next wait
            self._error = e


# ---------------------------------------------------------------- reading


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint `latest` names, or None. `latest` must name a `step-NNNNNN` directory beside it
    (never a path elsewhere): anything else is a UserError. (A resume uses `resume_checkpoint`, which falls back.)"""
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    name = _pointer_name(pointer)
    if name is None or not _STEP_DIR.fullmatch(name):
        shown = repr(name[:60]) if name is not None else "unreadable bytes"
        raise UserError(
            f"{pointer} names {shown}, not a checkpoint directory step-NNNNNN beside it: write the name of the "
            f"checkpoint to continue from into it (e.g. {_newest_name(root)}), or start a new run"
        )
    path = root / name
    return path if (path / STATE_JSON).is_file() or (path / LEGACY_STATE).is_file() else None


_STEP_DIR = re.compile(r"step-\d{6,}")


def _pointer_name(pointer: Path) -> str | None:
    """The name `latest` holds; None when it is gone or not UTF-8 (a StorageError when the storage keeps failing)."""
    try:
        return read_text_retrying(pointer).strip()
    except (OSError, UnicodeDecodeError):  # absent, or garbage
        return None


def _newest_name(root: Path) -> str:
    found = step_dirs(root)
    return found[0].name if found else "step-000010"


def step_dirs(root: Path) -> list[Path]:
    """The `step-NNNNNN` directories under `root`, newest first (intact or not; never `.partial` ones)."""
    found = [p for p in Path(root).glob("step-*") if _STEP_DIR.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step-")), reverse=True)


def checkpoint_problem(ckpt: Path) -> str:
    """Why checkpoint directory `ckpt` cannot be restored, as a verb phrase ("" = intact), from what
    `write_checkpoint` writes: checkpoint.json and trainer_state.json readable and of its step,
    trainer_state.safetensors, some weights (model.safetensors, a LoRA adapter, or state/ shards), and every
    safetensors file whole (headers and sizes only: cheap)."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        return "does not exist"
    if not (ckpt / STATE_JSON).is_file():
        legacy = f" (a pickled {LEGACY_STATE} from an older forgeweave is never loaded)"
        return f"has no {STATE_JSON}" + (legacy if (ckpt / LEGACY_STATE).is_file() else "")
    step = int(ckpt.name.removeprefix("step-")) if _STEP_DIR.fullmatch(ckpt.name) else None
    for name, keys in (("checkpoint.json", {"step"}), (STATE_JSON, {"step", "trainer"})):
        try:  # the storage failing the read (after retries) is a StorageError: stop, change nothing
            info = json.loads(read_text_retrying(ckpt / name))
        except (OSError, ValueError):  # absent, or not JSON
            return f"has a damaged {name} (missing, or not JSON)"
        if not isinstance(info, dict) or not keys <= info.keys() or step not in (None, info["step"]):
            return f"has a {name} that is not the record of its step"
    if not (ckpt / STATE_TENSORS).is_file():
        return f"has no {STATE_TENSORS}"
    files = sorted(ckpt.glob("*.safetensors")) + sorted((ckpt / SHARDS).glob("*.safetensors"))
    for f in files:
        if why := safetensors_problem(f):
            return f"has a damaged {f.relative_to(ckpt)} ({why})"
    if not (has_weights(ckpt) or is_adapter(ckpt) or any(k.startswith("model.") for k in shard_keys(ckpt))):
        return f"has no weights (no {WEIGHTS}, {ADAPTER}, or model tensors in {SHARDS}/)"
    return ""


def resume_checkpoint(root: Path) -> tuple[Path | None, str]:
    """The checkpoint a resume (or a recovery after a lost worker) continues from, and "" or one line saying why it
    is not the one `latest` names: that one when it is intact, else the newest intact `step-NNNNNN` (`latest`
    missing, unreadable, dangling or naming a damaged checkpoint). (None, why) when there is no step directory at
    all (the run starts from step 0); a UserError naming each when step directories exist but none is intact."""
    root = Path(root)
    pointer = root / "latest"
    name = _pointer_name(pointer) if pointer.is_file() else None
    if name is not None and _STEP_DIR.fullmatch(name) and not (why := checkpoint_problem(root / name)):
        return root / name, ""
    if not pointer.is_file():
        why = f"{pointer} is missing"
    elif name is None or not _STEP_DIR.fullmatch(name):
        why = f"{pointer} names {repr(name[:60]) if name is not None else 'unreadable bytes'}, not a step directory"
    else:
        why = f"{pointer} names {name}, which {why}"
    return newest_intact(root, why, told=name or "")


def newest_intact(root: Path, why: str, upto: int | None = None, told: str = "") -> tuple[Path | None, str]:
    """The newest intact checkpoint under `root` (at or before step `upto`, if given) and the line "`why`: using
    step-NNNNNN, the newest intact checkpoint"; (None, why) when there is no step directory; a UserError naming
    every one (but `told`, the one `why` is about already) when none is intact."""
    dirs = [d for d in step_dirs(root) if upto is None or int(d.name.removeprefix("step-")) <= upto]
    problems = []
    for d in dirs:
        if not (problem := checkpoint_problem(d)):
            return d, f"{why}: using {d.name}, the newest intact checkpoint{'' if upto is None else ' before it'}"
        problems += [f"{d.name} {problem}"] if d.name != told else []
    if not dirs:
        return None, why
    listed = f" ({'; '.join(problems)})" if problems else ""
    raise UserError(
        f"{why}, and no checkpoint{'' if upto is None else f' up to step {upto}'} is intact{listed}: copy an intact "
        f"step-NNNNNN directory back into {root} from a backup, or start a new run"
    )


def load_state(ckpt: Path) -> dict:
    """The checkpoint's non-model state (JSON + safetensors; nothing is unpickled); a damaged file is a UserError."""
    from safetensors.torch import load_file

    ckpt = Path(ckpt)
    if not (ckpt / STATE_JSON).is_file():
        raise UserError(
            f"checkpoint '{ckpt}' has no {STATE_JSON} (a pickled {LEGACY_STATE} from an older forgeweave is never "
            "loaded): start the run again, or resume it with the forgeweave version that wrote it"
        )
    tensors_file = ckpt / STATE_TENSORS
    try:
        tensors = read_retrying(tensors_file, lambda: load_file(tensors_file)) if tensors_file.is_file() else {}
        text = read_text_retrying(ckpt / STATE_JSON)
        state = join_tensors(json.loads(text), tensors)
        if not isinstance(state, dict) or not {"step", "trainer"} <= state.keys():
            raise ValueError("missing keys")
        return state
    except StorageError:  # the storage kept failing the read: not damage
        raise
    except Exception as e:  # json, safetensors (SafetensorError), unicode, a missing tensor key
        raise damaged(ckpt, e) from None


def damaged(ckpt: Path, e: BaseException) -> UserError:
    """The one-line error for a checkpoint whose files cannot be read (truncated, edited, half-copied)."""
    first = (str(e).strip().splitlines() or [""])[0][:160]
    return UserError(
        f"checkpoint '{ckpt}' is damaged ({type(e).__name__}: {first}): point {Path(ckpt).parent / 'latest'} at an "
        "earlier step-NNNNNN directory, or start a new run"
    )


def read_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's HF weights as one state dict (tied copies appear once)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        if f.name != STATE_TENSORS:
            try:
                state.update(read_retrying(f, lambda f=f: load_file(f)))
            except StorageError:  # the storage kept failing the read: not damage
                raise
            except Exception as e:  # SafetensorError on a truncated or edited file
                raise damaged(ckpt, e) from None
    return state


def load_weights(model, ckpt: Path) -> None:
    """Copy the checkpoint's weights into `model` in place (keeps the optimizer's parameter identity)."""
    assign_weights(model, read_weights(ckpt), source=str(ckpt))


def assign_weights(model, state: dict[str, torch.Tensor], source: str = "weights") -> None:
    """Copy a full state dict into `model` in place; tied copies (e.g. lm_head) may be missing from `state`."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k}
    assert not (set(missing) - tied) and not unexpected, f"{source} does not match the model"
    if tied:
        model.tie_weights()


# ---------------------------------------------------------------- retention


def apply_retention(root: Path, keep_last: int, keep_best: int) -> list[Path]:
    """Delete checkpoints outside keep_last newest + keep_best best, never the one `latest` names nor the newest
    intact one (`checkpoint_problem`: a newer checkpoint damaged on its way to disk never costs the last good one)."""
    dirs = sorted(p for p in root.glob("step-*") if p.is_dir())
    keep = set(dirs[-keep_last:]) if keep_last > 0 else set()
    intact = next((d for d in reversed(dirs) if not checkpoint_problem(d)), None)
    if intact is not None:
        keep.add(intact)
    scored = [(d, score_of(d)) for d in dirs]
    scored = [(d, s) for d, s in scored if s is not None]
    scored.sort(key=lambda ds: (-ds[1], ds[0].name))
    keep |= {d for d, _ in scored[:keep_best]}
    latest = latest_checkpoint(root)
    if latest is not None:
        keep.add(latest)
    removed = [d for d in dirs if d not in keep]
    for d in removed:
        shutil.rmtree(d, ignore_errors=True)
    return removed


def score_of(ckpt: Path) -> float | None:
    """The retention score checkpoint.json records (eval or probe pass@1), or None."""
    try:
        return json.loads((ckpt / "checkpoint.json").read_text()).get("eval_pass@1")
    except (OSError, ValueError):
        return None
