"""Copying ahead the memory image's pages that runs write (pie_actors/inferlet/image_pages.py):
on a private mapping of a plain file, then on the sandbox's runs."""
from __future__ import annotations

import ctypes
import mmap

from pie_actors.config import RunLimits
from pie_actors.inferlet import Sandbox
from pie_actors.inferlet.image_pages import ImagePages, copied_pages

PAGE = mmap.PAGESIZE
PAGES = 64


def _address(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def test_the_pages_an_instance_wrote_are_copied_into_the_next_before_it_starts(tmp_path):
    path = tmp_path / "image.bin"
    path.write_bytes(bytes(range(256)) * (PAGES * PAGE // 256))
    pages = ImagePages(str(path))
    assert pages.enabled

    def instance() -> mmap.mmap:
        with open(path, "r+b") as f:
            return mmap.mmap(f.fileno(), PAGES * PAGE, flags=mmap.MAP_PRIVATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)

    first, mapping, copied = pages.instantiate(instance)
    assert mapping == (_address(first), _address(first) + PAGES * PAGE) and copied == 0
    for page in (3, 4, 10):
        first[page * PAGE] = first[page * PAGE + 1]          # a read, then a write: a copy
    first[20 * PAGE]                                          # read only: still the file's page
    assert copied_pages(mapping) == {3, 4, 10}
    pages.watch(mapping)
    assert pages.ranges == [(3, 2), (10, 1)]

    second, mapping, copied = pages.instantiate(instance)
    assert copied == 3
    assert copied_pages(mapping) == {3, 4, 10}                # copies before the instance touched them
    assert second[:] == path.read_bytes()                     # ... of the file's contents
    for m in (first, second):
        m.close()


SOURCE = """
async def main(input: dict) -> dict:
    words = {f"w{i}": i * i for i in range(input["n"] * 100)}
    return {"n": len(words), "sum": sum(words.values())}
"""


def test_a_sandbox_copies_into_each_instance_the_image_pages_its_first_runs_wrote():
    limits = RunLimits(timeout_s=60, memory_mb=256)
    sandbox, plain = Sandbox(limits=limits), Sandbox(limits=limits, prefault=False)
    sandbox.image_pages = ImagePages(str(sandbox.artifact.path))     # a record of its own, not the process's
    results, copied = [], []
    for n in range(ImagePages.LEARN_RUNS + 2):
        stats: dict = {}
        results.append(sandbox.run(SOURCE, {"n": n}, stats=stats))
        copied.append(stats["prefaulted"])
    learned = sum(n for _, n in sandbox.image_pages.ranges)
    assert sandbox.image_pages.watched == ImagePages.LEARN_RUNS
    assert copied[0] == 0 and learned > 100                 # a run writes hundreds of the image's pages
    assert copied[-1] == learned
    stats = {}
    assert results == [plain.run(SOURCE, {"n": n}, stats=stats) for n in range(len(results))]
    assert stats["prefaulted"] == 0
