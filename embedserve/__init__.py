"""embedserve: a TorchServe handler and its model-archive tooling for Hugging Face text-embedding
models.

    embedserve.handler   what a worker runs (the .mar carries it): the TorchServe adapter, the
                         composition root, the service and its wings (docs/architecture.md)
    embedserve.archive   ./build_mar.sh: model staging, checks, the ONNX export, the .mar
    embedserve.scripts   python -m embedserve.scripts.serverctl | probe | loadtest
"""
