"""How bytes read, for the command line and the widgets alike: plain Python, no torch, no matplotlib,
so `labsupport memory` prints sizes without loading a plotting library."""
from __future__ import annotations

# Decimal units, as the workshop decks, datasheets and nccl-tests count bytes.
BYTE_UNITS = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3))


def format_bytes(n: float) -> str:
    """1234567890 -> '1.23 GB'; small values in MB or kB so a CPU model does not read as 0.00 GB."""
    for unit, scale in BYTE_UNITS:
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"
