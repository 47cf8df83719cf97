"""The compile tests' attention: ComfyUI's PyTorch attention on the CPU, as on a GPU.

A module of its own because dynamo traces ``pytorch_attention`` into the compiled graphs, and the
inductor cache keys them by its source position: edits elsewhere leave the cached graphs valid.
"""


def with_pytorch_attention(model):
    """A clone that runs ComfyUI's PyTorch attention, as on a GPU, so the UNet compiles as one graph.

    On the CPU ComfyUI picks sub-quadratic attention, which asks psutil for the free memory: a graph
    break in every attention, ~50 graphs and about twice the compile time. The compile tests
    (tests/test_t1_compile.py, test_t1_compile_hooks.py) use it.
    """
    import comfy.ldm.modules.attention as attention

    def pytorch_attention(func, *args, **kwargs):
        return attention.attention_pytorch(*args, **kwargs)

    clone = model.clone()
    clone.model_options["transformer_options"]["optimized_attention_override"] = pytorch_attention
    return clone
