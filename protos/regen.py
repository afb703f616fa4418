"""Regenerate the protobuf and gRPC modules from protos/online_check.proto.

    python -m protos.regen          # rewrite the generated files
    python -m protos.regen --check  # exit 1 if the committed files differ from what protoc generates now
"""
import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO = "protos/online_check.proto"
GENERATED = ["protos/online_check_pb2.py", "protos/online_check_pb2.pyi", "protos/online_check_pb2_grpc.py"]


def generate(out_dir: str) -> None:
    from grpc_tools import protoc  # a test/dev dependency, only needed here

    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", os.path.join(ROOT, PROTO)]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {PROTO}")


def stale_files() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        generate(tmp)
        stale = []
        for rel in GENERATED:
            with open(os.path.join(tmp, rel), "rb") as fresh:
                want = fresh.read()
            path = os.path.join(ROOT, rel)
            have = open(path, "rb").read() if os.path.exists(path) else None
            if have != want:
                stale.append(rel)
        return stale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report whether the generated files are stale")
    ns = parser.parse_args()
    if ns.check:
        stale = stale_files()
        if stale:
            print("stale generated files (run `python -m protos.regen`): " + ", ".join(stale))
            sys.exit(1)
        print("generated protobuf modules are up to date")
        return
    generate(ROOT)
    print("regenerated " + ", ".join(GENERATED))


if __name__ == "__main__":
    main()
