"""The named MoE shapes of the benchmarks (DESIGN.md section 7): tokens per GPU, H, F,
E, K. tools/mok.c carries the same table for the C command."""
SHAPES = {
    "qwen3-30b-a3b": (16384, 2048, 768, 128, 8),
    "gpt-oss-120b": (16384, 2880, 2880, 128, 4),
    "mixtral-8x7b": (8192, 4096, 14336, 8, 2),
    "deepseek-v3": (8192, 7168, 2048, 256, 8),
}
