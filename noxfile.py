"""Sessions: lint, tests (the locked env), upstream (one env per upstream.lock
entry), docs (the versioning table). `uv run nox` runs lint, tests, upstream."""

import tomllib
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True  # per-version envs are cached
nox.options.sessions = ["lint", "tests", "upstream"]

ROOT = Path(__file__).parent
LOCK = tomllib.loads((ROOT / "upstream.lock").read_text())["upstream"]
PYTHON = "3.11"
# titan-npu's own runtime needs beyond torch + torchtitan (pyproject.toml).
OWN_DEPS = ["tomli-w>=1.0", "pytest>=8", "pytest-xdist>=3.6"]


@nox.session(venv_backend="none")
def lint(session):
    session.run("uv", "run", "--frozen", "ruff", "check", ".")
    session.run("uv", "run", "--frozen", "ruff", "format", "--check", ".")


@nox.session(venv_backend="none")
def tests(session):
    """Unit + end-to-end tests in the locked environment (default upstream)."""
    session.run("uv", "run", "--frozen", "pytest", "-n", "2", *session.posargs)


@nox.session(python=PYTHON)
@nox.parametrize("version", [entry["version"] for entry in LOCK])
def upstream(session, version):
    """The suite against one locked upstream, installed from the lock's pins."""
    entry = next(e for e in LOCK if e["version"] == version)
    requirement = Path(session.create_tmp()) / "upstream.txt"
    requirement.write_text(
        f"torchtitan=={version} --hash=sha256:{entry['wheel_sha256']}\n"
    )
    # Hash-checked: the upstream wheel must be byte-for-byte the locked one.
    session.install("--require-hashes", "--no-deps", "-r", str(requirement))
    session.install(f"torch=={entry['torch']}", f"torchtitan=={version}", *OWN_DEPS)
    session.install("--no-deps", "-e", ".")
    session.run("titan-npu", "compat", "check")
    session.run("pytest", "-n", "2", *session.posargs)


@nox.session(venv_backend="none")
def docs(session):
    """Regenerate docs/versioning_policy.md from upstream.lock."""
    session.run("uv", "run", "--frozen", "titan-npu", "compat", "docs")
