"""The step's core, written once for every runtime: what a payload is (``payload``), memory around a compressor
(``feedback``, ``momentum``), building one from a spec (``factory``), the road a gradient travels (``road``), the
scatter route's owners (``owners``), parameters a step did not use (``unused``), resuming at another world size
(``elastic``), seeds every rank derives alike (``seeds``), telemetry (``telemetry``) and the files it is written to
(``records``). It knows no runtime."""
