"""Build hook of the specmesh SDK: generates the gRPC/protobuf stubs from `protos/`.

The stubs are written into `specmesh/v1/` (git-ignored) before the package is built, so that
`pip install ./sdk` and `pip install -e ./sdk` both produce an importable `specmesh.v1`.
The `.proto` files are looked up beside this file (`sdk/protos/`, as in an sdist) or one level
up (`protos/` at the top of the repository).
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def proto_root() -> Path:
    for candidate in (HERE / "protos", HERE.parent / "protos"):
        if (candidate / "specmesh" / "v1").is_dir():
            return candidate
    raise FileNotFoundError("specmesh protos not found next to sdk/ (expected ../protos/specmesh/v1)")


def generate_stubs() -> None:
    import grpc_tools
    from grpc_tools import protoc

    root = proto_root()
    protos = sorted(str(p.relative_to(root)) for p in (root / "specmesh" / "v1").glob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["grpc_tools.protoc", f"-I{root}", f"-I{include}", f"--python_out={HERE}",
            f"--pyi_out={HERE}", f"--grpc_python_out={HERE}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")


class BuildPyWithStubs(build_py):
    def run(self):
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildPyWithStubs})
