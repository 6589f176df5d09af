import sys, time, cProfile, pstats, io, jax
from segcli import engine
from segcli.io import open_batch
path = sys.argv[1]; dev = jax.devices()[0]
CH = engine.DEFAULT_CHUNK_ATOMS
with open_batch(path) as b:
    for op, fields in [("count", []), ("rms_norm", ["forces"])]:
        job = engine.plan(path, engine.OPS[op], fields, b.fields)
        for rep in range(3):
            t = time.perf_counter(); n = sum(1 for _ in engine.run(b, [job], dev)); print(op, "run", round(time.perf_counter() - t, 3), "chunks", n)
        t = time.perf_counter(); n = sum(1 for _ in engine._padded_chunks(b, [job], CH, slice(None))); print(op, "producer alone", round(time.perf_counter() - t, 3))
        items = list(engine._padded_chunks(b, [job], CH, slice(None)))[:4]
        t = time.perf_counter()
        for rep in range(5):
            for c, p in items: engine.compute([job], p, dev)
        print(op, "compute alone per chunk ms", round((time.perf_counter() - t) / 20 * 1e3, 2))
        pr = cProfile.Profile(); pr.enable()
        for _ in engine.run(b, [job], dev): pass
        pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(8); print(s.getvalue()[-2500:])
