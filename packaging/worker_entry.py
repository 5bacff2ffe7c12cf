"""Entry point of the one-file `idlegrid-worker` binary: `idlegrid worker ...`."""

import multiprocessing

from idlegrid.worker.commands import worker

if __name__ == "__main__":
    multiprocessing.freeze_support()  # task processes are spawned from this binary
    worker(prog_name="idlegrid-worker")
