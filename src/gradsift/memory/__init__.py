"""What a compressor keeps between steps, around it: error feedback (``feedback``, with the residual kept without a
copy for a rollback, ``kept``, or narrow, ``narrow``), momentum correction (``momentum``), the Adam direction
(``adam``; the optimizer's side, ``adam_step``), the wire's value cast whose rounding the memory keeps
(``wirecast``), and building a compressor with its memory from a spec (``factory``). Below it: the payload and the
compressors; it knows no route, transport or runtime."""
