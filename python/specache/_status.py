"""StatusError: a specache call that failed, with the Status code the C++ library returned."""

import enum


class StatusCode(enum.IntEnum):
    """Status codes; the numbers are gRPC's (specache/status.h)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class StatusError(Exception):
    """Raised for a non-OK Status: `code` (a StatusCode) and `message` as the library gave them."""

    def __init__(self, code: int, message: str):
        try:
            self.code = StatusCode(code)
        except ValueError:  # a code newer than this package: keep the number
            self.code = code
        self.message = message
        name = self.code.name if isinstance(self.code, StatusCode) else f"UNKNOWN_CODE({code})"
        super().__init__(f"{name}: {message}")

    def __reduce__(self):
        return (type(self), (int(self.code), self.message))
