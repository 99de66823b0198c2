"""What the op modules share: which upstream models use the layers they replace."""

MODELS = ("deepseek_v3", "llama3", "qwen3")
MOE_MODELS = ("deepseek_v3", "qwen3")
# 0.3.x builds titan-npu's qwen2 from upstream's decoder parts as well.
DECODERS_03 = (*MODELS, "qwen2")
