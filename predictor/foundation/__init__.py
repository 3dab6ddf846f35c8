"""What both halves stand on: input errors that name the file, line or field, atomic file
writes, YAML config reading, the SQLite connection, JSON values, problems logged once."""
