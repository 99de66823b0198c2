"""Per-process training entry: ``python -m torchtitan_npu.entry CONFIG.json``.

torchrun starts one of these per rank. It activates the overlay (so drift or
an untested upstream stops the run before training starts), translates the
resolved config once for the running era, hands it to upstream and runs
upstream's own ``torchtitan.train`` as ``__main__``.
"""

import json
import os
import runpy
import sys
import tempfile


def prepare_upstream(job_file: str) -> None:
    """Set upstream's command line, then activate the overlay.

    Must run before torchtitan is imported: 0.2.x binds ``sys.argv`` as a
    default argument when its config manager is imported. ``job_file`` is where
    ``hand_over`` puts upstream's input, if the era reads one.
    """
    from torchtitan_npu.bootstrap import activate
    from torchtitan_npu.compat import resolve_upstream
    from torchtitan_npu.config import era_config

    era = resolve_upstream().era
    sys.argv = ["torchtitan.train", *era_config(era).upstream_argv(job_file)]
    activate()  # imports torchtitan


def hand_over(config: dict, job_file: str) -> None:
    """Translate the resolved project config (once) and give it to upstream."""
    from torchtitan_npu.bootstrap import activate
    from torchtitan_npu.config import era_config

    activation = activate()
    from torchtitan.tools.logging import init_logger

    init_logger()  # upstream's log format, for what translation reports
    translator = era_config(activation.context.era)
    upstream_config = translator.translate(
        config,
        version=activation.upstream.installed.version,
        device_type=activation.context.device_type,
    )
    translator.hand_over(upstream_config, job_file)


def run_upstream() -> None:
    """Upstream's own entry point (0.2.0 has no main(); __main__ works everywhere)."""
    runpy.run_module("torchtitan.train", run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    from torchtitan_npu.errors import UserError
    from torchtitan_npu.launcher import die_with_parent, record_failure
    from torchtitan_npu.reporting.log_noise import quiet_upstream_noise

    die_with_parent()  # no orphan may keep writing checkpoints
    quiet_upstream_noise()
    try:
        _main(argv)
    except UserError as e:  # a clear message, not a traceback per rank
        record_failure(e)
        print(f"titan-npu: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except BaseException as e:
        record_failure(e)  # for the launcher's one-line summary
        raise


def _main(argv: list[str] | None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m torchtitan_npu.entry RESOLVED_CONFIG.json")
    with open(argv[0]) as f:
        config = json.load(f)

    fd, job_file = tempfile.mkstemp(prefix="titan-npu-job-")
    os.close(fd)
    try:
        prepare_upstream(job_file)
        hand_over(config, job_file)
        from torchtitan_npu.numerics.hooks import install_from_env

        install_from_env()  # numerics locate / --detect-nonfinite, when asked
        run_upstream()
    finally:
        os.unlink(job_file)


if __name__ == "__main__":
    main()
