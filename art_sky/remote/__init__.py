"""The machine a cluster server runs on, as the laptop sees it: run commands there (runner: this machine, or
ssh over paramiko), forward its port (tunnel), install this client's own build (install, wheel), and the server's
one lifecycle (start, wait until ready, read its log, stop)."""
