"""contextd: kv-elision's control-plane daemon.

It keeps sessions, pages (the KV manifest and page states), pins, leases, the tool-call ledger,
recurrent-state snapshot slots and usefulness scores in LMDB, and the canonical K/V payloads as
immutable checksummed files beside it. It knows nothing about tensors or models.

Layers, each depending only on those above it in this list:
  errors, ids      typed failures and identifier rules, shared by both ends of the socket
  wire             what both ends agree on: limits, the page-state enum, pin kinds
  keys, records    the typed LMDB keys and rows (each owns its encoding)
  store            the typed tables in LMDB, one batching writer
  blobs            the canonical store: files, checksums, the free-space reserve
  daemon           the verbs: store + blobs + the pressure policy, no wire types
  service          the gRPC edge: proto <-> daemon, every request validated here
  client           the one typed client (engine, CLI, tests, status readers)
  server, cli      the process: socket, lock, signals; and the `contextd` command
"""
