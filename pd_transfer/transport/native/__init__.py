"""The C source of the native copy loop and its build (see :mod:`.build`)."""
