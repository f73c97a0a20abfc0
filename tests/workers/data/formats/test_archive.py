"""Image archives: tar/tar.gz/zip read like folders, unpacked once, unsafe members refused."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from bnrecal.workers.data import DataAccess, ReadOptions, describe_dataset
from bnrecal.errors import DatasetError

SMALL = {"resize": 6, "crop": 6}


def png_bytes(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (6, 6, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


TREE = {f"{label}/{index}.png": png_bytes(index) for index, label in enumerate(["dog", "cat", "dog", "cat", "ant"])}


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def write_tar(path: Path, files: dict[str, bytes], mode: str = "w") -> Path:
    with tarfile.open(path, mode) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def write_zip(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


def all_paths(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


@pytest.mark.parametrize("suffix", ["tar", "tar.gz", "tgz", "zip"])
def test_archives_read_like_the_folder(tmp_path: Path, suffix: str) -> None:
    folder = describe_dataset(write_tree(tmp_path / "tree", TREE), ReadOptions(transform=SMALL))
    archive = tmp_path / f"calib.{suffix}"
    if suffix == "zip":
        write_zip(archive, TREE)
    else:
        write_tar(archive, TREE, "w:gz" if "gz" in suffix else "w")
    spec = describe_dataset(archive, ReadOptions(transform=SMALL), DataAccess(unpack_dir=tmp_path / "cache" / "u"))
    assert spec.classes == ("ant", "cat", "dog") and spec.num_samples == 5
    assert Path(spec.path) == tmp_path / "cache" / "u"
    assert torch.equal(spec.open().load(0, 5), folder.open().load(0, 5))


def test_unpack_goes_to_the_cache_once_and_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    archive = write_tar(tmp_path / "calib.tar.gz", {"calib/" + k: v for k, v in TREE.items()}, "w:gz")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    first = describe_dataset(archive, ReadOptions(transform=SMALL))
    unpacked = tmp_path / "xdg" / "bnrecal" / "unpacked" / digest
    assert Path(first.path) == unpacked / "calib"  # the wrapper folder is descended
    inode = unpacked.stat().st_ino
    second = describe_dataset(archive, ReadOptions(transform=SMALL, max_samples=2))
    assert second.path == first.path and unpacked.stat().st_ino == inode
    assert os.listdir(unpacked.parent) == [digest]  # no staging folder left behind
    assert torch.equal(second.open().load(0, 2), first.open().load(0, 2))


def test_concurrent_describes_share_one_unpack(tmp_path: Path) -> None:
    archive = write_zip(tmp_path / "calib.zip", TREE)
    target = tmp_path / "cache" / "u"
    with ThreadPoolExecutor(4) as pool:
        read, access = ReadOptions(transform=SMALL), DataAccess(unpack_dir=target)
        specs = list(pool.map(lambda _: describe_dataset(archive, read, access), range(4)))
    assert {s.path for s in specs} == {str(target)}
    assert os.listdir(tmp_path / "cache") == ["u"]
    assert all_paths(target) >= set(TREE)


def test_only_images_are_unpacked(tmp_path: Path) -> None:
    files = {**TREE, "README.txt": b"hello", "__MACOSX/dog/._0.png": b"junk", "dog/.DS_Store": b"junk"}
    spec = describe_dataset(
        write_zip(tmp_path / "a.zip", files), ReadOptions(transform=SMALL), DataAccess(unpack_dir=tmp_path / "u"),
    )
    assert spec.num_samples == 5
    assert {p for p in all_paths(tmp_path / "u") if p.endswith(".png")} == set(TREE)
    assert not (tmp_path / "u" / "README.txt").exists() and not (tmp_path / "u" / "__MACOSX").exists()


def test_an_occupied_unpack_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "u").mkdir()
    (tmp_path / "u" / "mine.txt").write_text("do not touch")
    with pytest.raises(DatasetError, match="already holds other files"):
        describe_dataset(write_zip(tmp_path / "a.zip", TREE), access=DataAccess(unpack_dir=tmp_path / "u"))
    assert all_paths(tmp_path / "u") == {"mine.txt"}


def tar_entry(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", link: str = "") -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, len(data)
    return info, data


UNSAFE_TARS = {
    "absolute path": ([tar_entry("/abs/evil.png", data=b"x")], "absolute path"),
    "parent component": ([tar_entry("dog/../../../evil.png", data=b"x")], r"'\.\.' component"),
    "symlink": ([tar_entry("dog/link.png", tarfile.SYMTYPE, link="/etc/passwd")], "symbolic link"),
    "hardlink": ([tar_entry("dog/hard.png", tarfile.LNKTYPE, link="dog/0.png")], "hard link"),
    "device": ([tar_entry("dog/dev.png", tarfile.CHRTYPE)], "device"),
    "fifo": ([tar_entry("dog/pipe.png", tarfile.FIFOTYPE)], "device or special"),
}


@pytest.mark.parametrize("case", sorted(UNSAFE_TARS))
def test_unsafe_tar_members_refuse_the_archive(tmp_path: Path, case: str) -> None:
    entries, match = UNSAFE_TARS[case]
    archive = tmp_path / "work" / "bad.tar"
    archive.parent.mkdir()
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in TREE.items():  # safe members first: they must not survive either
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if data else None)
    with tarfile.open(archive) as tar:
        assert tar.getnames()[-1] == entries[-1][0].name  # the unsafe name was written as is
    with pytest.raises(DatasetError, match=match):
        describe_dataset(archive, access=DataAccess(unpack_dir=tmp_path / "cache" / "deep" / "u"))
    assert all_paths(tmp_path) == {"work", "work/bad.tar", "cache", "cache/deep"}


def zip_entry(name: str, data: bytes = b"x", mode: int = 0) -> tuple[zipfile.ZipInfo, bytes]:
    info = zipfile.ZipInfo(name)
    info.external_attr = mode << 16
    return info, data


UNSAFE_ZIPS = {
    "absolute path": ([zip_entry("/abs/evil.png")], "absolute path"),
    "parent component": ([zip_entry("../../evil.png")], r"'\.\.' component"),
    "windows parent": ([zip_entry("..\\..\\evil.png")], r"'\.\.' component"),
    "drive letter": ([zip_entry("C:/evil.png")], "absolute path"),
    "symlink": ([zip_entry("dog/link.png", b"/etc/passwd", stat.S_IFLNK | 0o777)], "symbolic link"),
    "device": ([zip_entry("dog/dev.png", b"", stat.S_IFCHR | 0o644)], "device"),
}


@pytest.mark.parametrize("case", sorted(UNSAFE_ZIPS))
def test_unsafe_zip_members_refuse_the_archive(tmp_path: Path, case: str) -> None:
    entries, match = UNSAFE_ZIPS[case]
    archive = tmp_path / "work" / "bad.zip"
    archive.parent.mkdir()
    with zipfile.ZipFile(archive, "w") as zf:
        for name, data in TREE.items():
            zf.writestr(name, data)
        for info, data in entries:
            zf.writestr(info, data)
    with pytest.raises(DatasetError, match=match):
        describe_dataset(archive, access=DataAccess(unpack_dir=tmp_path / "cache" / "deep" / "u"))
    assert all_paths(tmp_path) == {"work", "work/bad.zip", "cache", "cache/deep"}


@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_member_count_is_bounded(tmp_path: Path, kind: str) -> None:
    archive = write_tar(tmp_path / "a.tar", TREE) if kind == "tar" else write_zip(tmp_path / "a.zip", TREE)
    with pytest.raises(DatasetError, match="more than 4 members.*max_members"):
        describe_dataset(archive, access=DataAccess(unpack_dir=tmp_path / "c" / "u", max_members=4))
    assert all_paths(tmp_path / "c") == set()
    assert describe_dataset(archive, access=DataAccess(unpack_dir=tmp_path / "c" / "u", max_members=5)).num_samples == 5


@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_unpacked_size_is_bounded(tmp_path: Path, kind: str) -> None:
    archive = write_tar(tmp_path / "a.tar", TREE) if kind == "tar" else write_zip(tmp_path / "a.zip", TREE)
    total = sum(len(data) for data in TREE.values())
    with pytest.raises(DatasetError, match="max_unpacked_bytes"):
        describe_dataset(archive, access=DataAccess(unpack_dir=tmp_path / "c" / "u", max_unpacked_bytes=total - 1))
    assert all_paths(tmp_path / "c") == set()
    assert describe_dataset(
        archive, access=DataAccess(unpack_dir=tmp_path / "c" / "u", max_unpacked_bytes=total),
    ).num_samples == 5


def test_declared_size_is_refused_before_any_data_is_read(tmp_path: Path) -> None:
    header = tarfile.TarInfo("dog/huge.png")
    header.size = 10**12  # a terabyte declared, none present: refused from the header alone
    (tmp_path / "bomb.tar").write_bytes(header.tobuf(tarfile.GNU_FORMAT) + b"\0" * 1024)
    with pytest.raises(DatasetError, match="max_unpacked_bytes"):
        describe_dataset(tmp_path / "bomb.tar", access=DataAccess(unpack_dir=tmp_path / "c" / "u"))
    assert all_paths(tmp_path / "c") == set()


@pytest.mark.parametrize("name", ["bad.tar.gz", "bad.zip", "bad.tar"])
def test_corrupt_archives_are_refused(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(DatasetError, match=r"bad\.(tar|zip)"):
        describe_dataset(tmp_path / name, access=DataAccess(unpack_dir=tmp_path / "c" / "u"))
    assert all_paths(tmp_path / "c") == set()


def test_an_archive_without_images_is_empty(tmp_path: Path) -> None:
    archive = write_zip(tmp_path / "docs.zip", {"a.txt": b"text", "b/c.csv": b"1,2"})
    with pytest.raises(DatasetError, match="no images"):
        describe_dataset(archive, access=DataAccess(unpack_dir=tmp_path / "u"))


def test_an_archive_blob_without_extension_is_recognised(tmp_path: Path) -> None:
    write_tar(tmp_path / "blob", TREE, "w:gz")
    spec = describe_dataset(tmp_path / "blob", ReadOptions(transform=SMALL), DataAccess(unpack_dir=tmp_path / "u"))
    assert spec.num_samples == 5 and spec.classes == ("ant", "cat", "dog")


def zero_stream(size: int):
    """``size`` zero bytes as a readable stream, never held whole."""

    class Zeros(io.RawIOBase):
        left = size

        def readable(self) -> bool:
            return True

        def readinto(self, buffer) -> int:
            count = min(len(buffer), self.left)
            buffer[:count] = b"\0" * count
            self.left -= count
            return count

    return io.BufferedReader(Zeros())


@pytest.mark.parametrize("kind", ["zip", "tar.gz"])
def test_a_decompression_bomb_is_refused_before_it_fills_the_disk(tmp_path: Path, kind: str) -> None:
    size = 64 * 2**20  # 64 MiB of zeros named like an image: a ~64 KiB archive
    archive = tmp_path / f"bomb.{kind}"
    if kind == "zip":
        with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr("ok/0.png", png_bytes(0))
            with zf.open("ok/huge.png", "w", force_zip64=True) as member:
                stream = zero_stream(size)
                while chunk := stream.read(1 << 20):
                    member.write(chunk)
    else:
        with tarfile.open(archive, "w:gz") as tar:
            info = tarfile.TarInfo("ok/huge.png")
            info.size = size
            tar.addfile(info, zero_stream(size))
    assert archive.stat().st_size < size / 200
    with pytest.raises(DatasetError, match=r"expands \d+:1.*decompression bomb.*BNRECAL_MAX_COMPRESSION_RATIO"):
        describe_dataset(archive, access=DataAccess(unpack_root=tmp_path / "cache"))
    assert all_paths(tmp_path / "cache") == set()  # nothing written stays, not even the staging folder
    # the same archive under a ratio the operator raised unpacks (and then fails on decoding, below)


def test_the_compression_ratio_is_not_held_against_real_images(tmp_path: Path) -> None:
    archive = write_zip(tmp_path / "a.zip", TREE)  # tiny PNGs: any ratio below the first MiB is fine
    assert describe_dataset(
        archive, access=DataAccess(unpack_root=tmp_path / "cache", max_compression_ratio=1),
    ).num_samples == 5


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` pixels: Pillow refuses it on the header alone."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_a_pixel_bomb_inside_a_valid_archive_fails_clearly_and_its_unpack_is_removed(tmp_path: Path) -> None:
    archive = write_zip(tmp_path / "pixels.zip", TREE | {"dog/bomb.png": png_header_only(20000, 20000)})
    with pytest.raises(DatasetError, match=r"bomb\.png.*(decompression bomb|exceeds limit|pixels)"):
        describe_dataset(archive, access=DataAccess(unpack_root=tmp_path / "cache"))
    assert all_paths(tmp_path / "cache") == set()  # the unpack of an archive with bad content is gone
