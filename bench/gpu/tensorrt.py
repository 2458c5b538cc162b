"""What a machine offers a TensorRT engine, without importing torch or TensorRT: recorded by
`bench.gpu` (environment.tensorrt) and by `bench.gpu_serve` (serving.json's tensorrt)."""

from __future__ import annotations


def tensorrt_offer() -> dict:
    """What this machine offers a TensorRT engine: whether the tensorrt and torch_tensorrt
    packages are installed (found, not imported: TensorRT takes seconds and memory to import), and
    the execution providers ONNX Runtime was built with (listed; whether their libraries load is
    known only when a session starts)."""
    import importlib.metadata
    import importlib.util

    import onnxruntime

    def version(*distributions: str) -> str | None:
        for name in distributions:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
        return None

    providers = onnxruntime.get_available_providers()
    return {
        "tensorrt": version("tensorrt", "tensorrt-cu12", "tensorrt-cu13") if importlib.util.find_spec("tensorrt")
        else None,
        "torch_tensorrt": version("torch-tensorrt", "torch_tensorrt") if importlib.util.find_spec("torch_tensorrt")
        else None,
        "onnxruntime": version("onnxruntime-gpu", "onnxruntime"),
        "onnxruntime_providers": providers,
        "onnxruntime_tensorrt": "TensorrtExecutionProvider" in providers,
        "onnxruntime_cuda": "CUDAExecutionProvider" in providers,
    }
