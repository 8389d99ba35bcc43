"""What starts processes or trains: commands run as a user runs them, the server, restarts,
signals, exports loaded by their own runtimes, runs on the real corpora."""
