"""KernelBench's static check of a CUDA submission, as its kernel_static_checker.py
(ScalingIntelligence/KernelBench, src/kernelbench/kernel_static_checker.py at 0ba2054) words it:
the errors that fail a submission and the warnings it flags. It strips from the first '#' or
'//' of every line (even inside strings), then searches. tests/test_export.py checks the exports
against these; scripts/check_export.py prints what they find."""

import re

ALLOWED_NN = r"(Module|parameter|Parameter|ParameterList|ParameterDict|ModuleList|ModuleDict|init)\b"
COMPUTE_OPS = (
    "mm bmm matmul einsum conv conv1d conv2d conv3d conv_transpose1d conv_transpose2d "
    "conv_transpose3d avg_pool1d avg_pool2d avg_pool3d max_pool1d max_pool2d max_pool3d "
    "adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d "
    "adaptive_max_pool2d adaptive_max_pool3d relu hardtanh elu selu leaky_relu gelu softsign "
    "softplus softmax log_softmax tanh sigmoid hardsigmoid silu mish batch_norm group_norm "
    "layer_norm instance_norm rms_norm normalize linear cross_entropy kl_div mse_loss huber_loss "
    "triplet_margin_loss cosine_similarity logsumexp clamp dropout").split()
# Errors (a submission with any is invalid) and warnings; the project keeps clear of both.
FORBIDDEN = {
    "try/except": [r"\btry\s*:", r"\bexcept\s*:", r"\bexcept\s+\w+"],
    "pass statement": [r"\bpass\b"],
    "torch.nn compute module": [r"torch\.nn\.(?!" + ALLOWED_NN + ")"],
    "functional op": [r"torch\.nn\.functional\.\w+", r"\bnn\.functional\.\w+",
                      r"\bF\.(conv|linear|relu|gelu|softmax|batch_norm|layer_norm|dropout|max_pool|avg_pool)"],
    "torch compute op": [r"\btorch\.(" + "|".join(COMPUTE_OPS) + r")(?=\s*\(|\s|$)"],
    "streams": [r"torch\.cuda\.Stream\(", r"with\s+torch\.cuda\.stream", r"\.wait_stream\(",
                r"\.record_stream\("],
    "concurrency": [r"\bthreading\b", r"\bmultiprocessing\b", r"concurrent\.futures"],
    "tensor subclass": [r"class\s+\w+\s*\(\s*torch\.Tensor\s*\)", r"_make_subclass"],
    "timing reassignment": [r"torch\.cuda\.Event\s*=(?!=)", r"\btime\.(time|perf_counter)\s*=(?!=)",
                            r"elapsed_time\s*=(?!=)"],
}
# Its "precision downgrade" warning for an fp32 problem: FP32_TO_FP16_PATTERNS, copied as they
# are there ("Precision downgrade detected: required FP32 but code uses FP16").
FP32_TO_FP16 = [
    r"__float2half(_rn)?\s*\(",
    r"\(\s*__half\s*\)\s*[\w\->\.]+",
    r"static_cast\s*<\s*(__half|half)\s*>\s*\(",
    r"tl\.astype\s*\(\s*[^,]+,\s*tl\.float16\s*\)",
    r"NumericConverter\s*<\s*half_t\s*,\s*float\s*>",
    r"LinearCombination\s*<\s*half_t",
    r"type_convert\s*<\s*half_t\s*>\s*\(",
    r"tk::half\s*\(",
    r"\.half\s*\(",
    r"\.float16\s*\(",
    r"\.to\s*\(\s*torch\.(float16|half)\b",
    r"\.to\s*\(\s*dtype\s*=\s*torch\.(float16|half)\b",
]


def strip_comments(code: str) -> str:
    out = []
    for line in code.split("\n"):
        for mark in ("#", "//"):
            if mark in line:
                line = line[:line.index(mark)]
        out.append(line)
    return "\n".join(out)


def violations(code: str):
    """Every rule of FORBIDDEN that the code breaks, with what matched."""
    code = strip_comments(code)
    return [f"{rule}: {m.group(0)!r}" for rule, patterns in FORBIDDEN.items()
            for pattern in patterns for m in re.finditer(pattern, code)]


def precision_downgrades(code: str):
    """What KernelBench's precision-downgrade warning would match in the code."""
    code = strip_comments(code)
    return [m.group(0) for pattern in FP32_TO_FP16 for m in re.finditer(pattern, code)]
