"""The floor the device plugin's process is measured against (``bench/plugin_device.py`` starts it).

A Python gRPC server on a unix socket with no service at all: what any Python gRPC plugin costs at rest
(memory, idle CPU) and at start (interpreter, ``grpc`` import, bind). It imports the generated device plugin
stubs, as every plugin must. Runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path
from types import FrameType

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from schemas.generated.kubelet.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc  # noqa: F401 - part of the floor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    options = parser.parse_args()
    stop = threading.Event()

    def on_signal(number: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_insecure_port(f"unix:{options.socket}")
    server.start()
    while not stop.wait(3600):
        pass
    server.stop(0).wait()


if __name__ == "__main__":
    main()
