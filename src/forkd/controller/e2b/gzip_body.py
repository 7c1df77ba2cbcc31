"""A request body sent ``Content-Encoding: gzip`` (E2B's ``files.write(..., gzip=True)``),
inflated as it streams in, and never past ``limit`` bytes inflated: a small body that
would inflate past it (a gzip bomb) is refused at that point, nothing of it kept."""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator

from forkd.errors import Invalid

GZIP_WBITS = 16 + zlib.MAX_WBITS  # a gzip header and trailer around the deflate stream
STEP = 1 << 20  # inflated bytes given out at a time


def content_encoding(header: str | None) -> str | None:
    """``gzip``, or None for an identity body; Invalid for any other encoding."""
    encoding = (header or "identity").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "x-gzip"):
        return "gzip"
    raise Invalid(f"Content-Encoding {encoding[:20]!r}: a body is identity or gzip here")


async def inflated(body: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    """``body`` gunzipped, a piece at a time, at most ``limit`` bytes in all."""
    inflater = zlib.decompressobj(GZIP_WBITS)
    given = 0
    try:
        async for chunk in body:
            pending = chunk
            while pending:
                out = inflater.decompress(pending, STEP)
                pending = inflater.unconsumed_tail
                given += len(out)
                if given > limit:
                    raise Invalid(f"the gzip body inflates past the upload limit ({limit} bytes)")
                if out:
                    yield out
        rest = inflater.flush()
        given += len(rest)
        if given > limit:
            raise Invalid(f"the gzip body inflates past the upload limit ({limit} bytes)")
        if not inflater.eof:
            raise Invalid("the gzip body ended before its end")
        if rest:
            yield rest
    except zlib.error as exc:
        raise Invalid(f"the body is not gzip: {exc}") from None
