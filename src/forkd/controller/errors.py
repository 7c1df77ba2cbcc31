"""Errors the API turns into ``{"error": ...}`` answers."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def not_found(what: str) -> ApiError:
    return ApiError(404, f"{what} not found")
