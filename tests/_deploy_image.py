"""The app image of deploy/Dockerfile, replayed without Docker into a cached directory.

The Dockerfile's COPY and RUN steps are replayed into a fresh virtualenv from a
clean `git archive` of this checkout (tracked files, with uncommitted edits,
nothing else lying around). The replay is kept in .venv-deploy-image/ under a
key: the hash of the Dockerfile, of every file its COPY steps bring and of the
Python that runs it. So `pip install` runs when one of them changed, and before
pytest: ./scripts/test calls `python tests/_deploy_image.py` ahead of the
tooling job, and tests/test_deploy_replay.py finds the image ready (it builds
it itself, under a long timeout, when run alone on a changed tree).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".venv-deploy-image"
# RUN commands the replay skips, and why; any other command fails the test.
SKIPPED = {"useradd": "creates the image's unprivileged user (needs root; nothing to install)"}
PIP_TIMEOUT = 900


def archive(destination: Path) -> None:
    """`git archive` of the working tree's tracked files (uncommitted edits included, untracked not)."""
    tree = subprocess.run(["git", "stash", "create"], cwd=ROOT, capture_output=True, text=True, check=True)
    ref = tree.stdout.strip() or "HEAD"
    data = subprocess.run(["git", "archive", "--format=tar", ref], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(destination, filter="data")


def dockerfile_steps(context: Path = ROOT) -> list[tuple[str, str]]:
    """(instruction, arguments) of deploy/Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (context / "deploy" / "Dockerfile").read_text())
    steps = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            instruction, _, arguments = line.strip().partition(" ")
            steps.append((instruction.upper(), arguments.strip()))
    return steps


def key(context: Path) -> str:
    """What the image is made of: the Dockerfile, every file its COPY steps read, this Python."""
    digest = hashlib.sha256(sys.version.encode())
    digest.update((context / "deploy" / "Dockerfile").read_bytes())
    for instruction, arguments in dockerfile_steps(context):
        if instruction != "COPY":
            continue
        for source in shlex.split(arguments)[:-1]:
            origin = context / source
            files = sorted(p for p in origin.rglob("*") if p.is_file()) if origin.is_dir() else [origin]
            for path in files:
                digest.update(str(path.relative_to(context)).encode() + b"\0")
                digest.update(path.read_bytes() if path.exists() else b"(missing)")
    return digest.hexdigest()


def replay(context: Path, image: Path) -> Path:
    """Run the Dockerfile's steps with `image` as the container's root; return the virtualenv's bin."""
    venv = image / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    workdir, env = image, {**os.environ}
    for instruction, arguments in dockerfile_steps(context):
        if instruction == "WORKDIR":
            workdir = image / arguments.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif instruction == "ENV":
            env.update(dict(re.findall(r'(\w+)=("[^"]*"|\S+)', arguments)))
        elif instruction == "COPY":
            *sources, target = shlex.split(arguments)
            for source in sources:
                origin, into = context / source, workdir / target
                assert origin.exists(), f"COPY {source}: not in the build context (a clean archive)"
                if origin.is_dir():
                    shutil.copytree(origin, into if not target.endswith("/") else into / origin.name,
                                    dirs_exist_ok=True)
                else:
                    (into if target.endswith("/") or into.is_dir() else into.parent).mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, into / origin.name if target.endswith("/") or into.is_dir() else into)
        elif instruction == "RUN":
            for command in arguments.split("&&"):
                argv = shlex.split(command)
                if argv[0] in SKIPPED:
                    continue
                assert argv[:2] == ["pip", "install"], f"RUN {command.strip()!r}: not replayed, teach this test"
                subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *argv[2:]],
                               cwd=workdir, env=env, check=True, timeout=PIP_TIMEOUT)
        else:
            assert instruction in ("FROM", "USER", "EXPOSE", "CMD", "HEALTHCHECK"), instruction
    return venv / "bin"


def ensure_image(context: Path, cache: Path = CACHE) -> Path:
    """The replayed image's virtualenv bin for `context` (a clean archive): from the cache, else built now."""
    wanted = key(context)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.parent / f"{cache.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two workers or two runs build it once
        stamp = cache / "key"
        bin_dir = cache / "image" / "venv" / "bin"
        if stamp.is_file() and stamp.read_text() == wanted and (bin_dir / "python").is_file():
            return bin_dir
        shutil.rmtree(cache, ignore_errors=True)
        (cache / "image").mkdir(parents=True)
        built = replay(context, cache / "image")
        stamp.write_text(wanted)
        return built


def main() -> int:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="otel-lock-context-") as context:
        archive(Path(context))
        wanted = key(Path(context))
        stamp = CACHE / "key"
        cached = stamp.is_file() and stamp.read_text() == wanted
        print(f"== deploy image: {'cached' if cached else 'replaying deploy/Dockerfile'} in {CACHE.name}/",
              file=sys.stderr, flush=True)
        ensure_image(Path(context))
    return 0


if __name__ == "__main__":
    sys.exit(main())
