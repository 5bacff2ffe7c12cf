"""macOS and Windows idle probes (ctypes), and the user-session helper's file.

Windows' GetLastInputInfo sees only its own session, so a worker running as a service
(session 0) cannot see the owner's input: `idlegrid worker idle-helper`, started in the
owner's session (at logon, like BOINC's boinctray), writes its reading to a file in the
worker's state directory, and `HelperFileProbe` reads it. The same helper serves a Linux
system service that cannot open the owner's X display.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from idlegrid.worker.idle.base import ProbeUnavailable

HELPER_FILE = "idle-helper.json"
HELPER_STALE_S = 10.0  # a helper reading older than this is a helper that stopped


class MacHidIdleProbe:
    """IOKit's HIDIdleTime of the IOHIDSystem service, in nanoseconds."""

    name = "macos-hid"

    def __init__(self) -> None:
        self._lib: Any = None

    def idle_seconds(self) -> float:
        if sys.platform != "darwin":
            raise ProbeUnavailable("not macOS")
        iokit, cf = self._libraries()
        service = iokit.IOServiceGetMatchingService(0, iokit.IOServiceMatching(b"IOHIDSystem"))
        if not service:
            raise ProbeUnavailable("IOKit has no IOHIDSystem service")
        try:
            key = cf.CFStringCreateWithCString(None, b"HIDIdleTime", 0x08000100)  # UTF-8
            number = iokit.IORegistryEntryCreateCFProperty(service, key, None, 0)
            cf.CFRelease(key)
            if not number:
                raise ProbeUnavailable("IOHIDSystem has no HIDIdleTime")
            nanoseconds = ctypes.c_int64()
            cf.CFNumberGetValue(number, 4, ctypes.byref(nanoseconds))  # kCFNumberSInt64Type
            cf.CFRelease(number)
        finally:
            iokit.IOObjectRelease(service)
        return nanoseconds.value / 1e9

    def _libraries(self) -> tuple[Any, Any]:
        if self._lib is None:
            iokit = ctypes.cdll.LoadLibrary("/System/Library/Frameworks/IOKit.framework/IOKit")
            cf = ctypes.cdll.LoadLibrary(
                "/System/Library/Frameworks/CoreFoundation.framework/CoreFoundation"
            )
            iokit.IOServiceMatching.restype = ctypes.c_void_p
            iokit.IOServiceMatching.argtypes = [ctypes.c_char_p]
            iokit.IOServiceGetMatchingService.restype = ctypes.c_uint32
            iokit.IOServiceGetMatchingService.argtypes = [ctypes.c_uint32, ctypes.c_void_p]
            iokit.IORegistryEntryCreateCFProperty.restype = ctypes.c_void_p
            iokit.IORegistryEntryCreateCFProperty.argtypes = [
                ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32,
            ]  # fmt: skip
            iokit.IOObjectRelease.argtypes = [ctypes.c_uint32]
            cf.CFStringCreateWithCString.restype = ctypes.c_void_p
            cf.CFStringCreateWithCString.argtypes = [
                ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32,
            ]  # fmt: skip
            cf.CFNumberGetValue.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
            cf.CFRelease.argtypes = [ctypes.c_void_p]
            self._lib = (iokit, cf)
        return self._lib


class _LastInputInfo(ctypes.Structure):
    _fields_ = [("cbSize", ctypes.c_uint), ("dwTime", ctypes.c_uint)]


class WindowsLastInputProbe:
    """user32's GetLastInputInfo against GetTickCount (input of its own logon session only)."""

    name = "windows-last-input"

    def idle_seconds(self) -> float:
        if sys.platform != "win32":
            raise ProbeUnavailable("not Windows")
        windll: Any = ctypes.windll  # type: ignore[attr-defined]
        info = _LastInputInfo(cbSize=ctypes.sizeof(_LastInputInfo))
        if not windll.user32.GetLastInputInfo(ctypes.byref(info)):
            raise ProbeUnavailable("GetLastInputInfo failed (no interactive session?)")
        now_ms = windll.kernel32.GetTickCount() & 0xFFFFFFFF
        return ((now_ms - info.dwTime) & 0xFFFFFFFF) / 1000.0  # the tick count wraps


class HelperFileProbe:
    """The reading the user-session helper last wrote, if it is fresh."""

    name = "session-helper"

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / HELPER_FILE

    def idle_seconds(self) -> float:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            raise ProbeUnavailable(f"no session helper writes {self.path}") from None
        except ValueError as exc:
            raise ProbeUnavailable(f"unreadable {self.path}: {exc}") from None
        age = time.time() - float(data["written_at"])
        if age > HELPER_STALE_S:
            raise ProbeUnavailable(f"the session helper stopped {age:.0f} s ago")
        return float(data["idle_s"]) + max(0.0, age)


def write_helper_reading(state_dir: Path, idle_s: float, probe: str) -> None:
    """Atomically replace the helper file (the worker never reads half of it)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / HELPER_FILE
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps({"idle_s": idle_s, "probe": probe, "written_at": time.time()}))
    os.replace(scratch, path)
