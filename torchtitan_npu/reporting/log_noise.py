"""Upstream log lines that say nothing a titan-npu user can act on.

Each is dropped at its logger with the reason it cannot matter; everything
else upstream logs is left alone.
"""

import logging

# message prefix -> why it is noise under titan-npu
UPSTREAM_NOISE = {
    "initial_load_model_only=True has no effect without an initial_load_path": (
        "0.3.x warns about its own default each time a config is built"
    ),
}


class _DropNoise(logging.Filter):
    def __init__(self, embedded_assets: str | None) -> None:
        super().__init__()
        self.embedded_assets = embedded_assets

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(tuple(UPSTREAM_NOISE)):
            return False
        # The embedded tokenizer folder is not an HF checkpoint: no index there.
        return not (
            self.embedded_assets
            and message.startswith("model.safetensors.index.json not found")
            and self.embedded_assets in message
        )


def quiet_upstream_noise() -> None:
    """Install the filter on the root logger (torchtitan logs there), once."""
    from torchtitan_npu.assets.builder import cache_root

    root = logging.getLogger()
    if not any(isinstance(f, _DropNoise) for f in root.filters):
        root.addFilter(_DropNoise(str(cache_root())))
