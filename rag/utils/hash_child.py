"""Hash files at a low priority in a child interpreter: ``python hash_child.py NICE PARENT_PID FILE...``.

Started by :func:`rag.utils.checksums.sha256_files` (``nice=``) as a plain script (stdlib only, so it runs under
``python -I`` whatever the environment), so that verifying a large knowledge base competes for the CPU at a lower
priority than the process serving requests and never holds its GIL. It also yields the disk: 1 MiB reads without
readahead, and after a read that missed the page cache it pauses as long as that read took. It prints one hex
digest per line and stops (exit 3) once the parent is gone.
"""

import hashlib
import os
import sys
import time

YIELD_CHUNK = 1 << 20


def main(argv: list) -> int:
    try:
        now = os.nice(0)
        if now < int(argv[0]):
            os.nice(int(argv[0]) - now)
    except (AttributeError, OSError):
        pass
    parent = int(argv[1])
    buf = bytearray(YIELD_CHUNK)
    view = memoryview(buf)
    nowait = getattr(os, "RWF_NOWAIT", None) if hasattr(os, "preadv") else None
    for name in argv[2:]:
        h = hashlib.sha256()
        fd = os.open(name, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: at most one read of ours in flight
            offset = 0
            while True:
                n = -1
                if nowait is not None:
                    try:
                        n = os.preadv(fd, [view], offset, nowait)  # only what is in the page cache, never waits
                    except BlockingIOError:
                        n = -1
                    except OSError:
                        nowait = None  # not supported here
                if n <= 0:  # not cached (or unknown): read from the disk, then leave it idle as long
                    t = time.monotonic()
                    n = os.preadv(fd, [view], offset)
                    if n and nowait is not None:
                        time.sleep(time.monotonic() - t)
                if not n:
                    break
                h.update(view[:n])
                offset += n
                if os.getppid() != parent:
                    return 3  # whoever asked is gone: stop
        finally:
            os.close(fd)
        sys.stdout.write(h.hexdigest() + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
