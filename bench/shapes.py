"""The named MoE shapes of the benchmarks (DESIGN.md section 7): tokens per GPU, H, F,
E, K. tools/mok.c carries the same table for the C command."""
SHAPES = {
    "qwen3-30b-a3b": (16384, 2048, 768, 128, 8),
    "gpt-oss-120b": (16384, 2880, 2880, 128, 4),
    "mixtral-8x7b": (8192, 4096, 14336, 8, 2),
    "deepseek-v3": (8192, 7168, 2048, 256, 8),
}


def step_flops(T, H, F, E, K):
    """A training step's FLOPs (forward + backward): 3 x the forward's 6 T K H F (three
    expert projections) + 2 T H E (router), DESIGN.md section 7."""
    return 3 * (6 * T * K * H * F + 2 * T * H * E)


def hot_experts(E):
    """Skewed routing in the benchmarks: the first E/32 experts (at least one) get a
    selection bias that makes them every token's first choices."""
    return max(1, E // 32)
