"""Process helpers: children that end with their parent, loopback ports for a process to bind later."""
