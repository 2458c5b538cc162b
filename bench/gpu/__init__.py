"""The GPU benchmark, run as `python -m bench.gpu` (__main__.py: its arguments and the order of
its sections). A module a responsibility; the steps take and return plain data, so none imports
another (speed borrows correctness's `compare`; all share common):

    environment   versions, the GPU, SDPA probes, the peak FLOPS that MFU divides by
    models        the served, tiny, random and float16 model folders
    engines       engines started as a worker starts them; start-up times and peak memory
    correctness   modes against the fp32 reference; adversarial cases for graph replay
    speed         latency, saturation, packed against padded, the whole `handle`
    report        gpu.json checkpoints, the targets, gpu.png
    common        the TorchServe batch, mode names, progress lines
"""
