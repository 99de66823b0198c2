"""Per-process training entry: ``python -m torchtitan_npu.entry CONFIG.json``.

torchrun starts one of these per rank. It activates the overlay (so drift or
an untested upstream stops the run before training starts), then hands the
resolved config to the running era's upstream entry point.
"""

import json
import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m torchtitan_npu.entry RESOLVED_CONFIG.json")
    with open(argv[0]) as f:
        config = json.load(f)

    from torchtitan_npu.bootstrap import activate
    from torchtitan_npu.config import launch

    activation = activate()
    launch(
        config,
        era=activation.upstream.era,
        version=activation.upstream.installed.version,
    )


if __name__ == "__main__":
    main()
