"""What the op modules share: which upstream models use the layers they replace."""

MODELS = ("deepseek_v3", "llama3", "qwen3")
MOE_MODELS = ("deepseek_v3", "qwen3")
