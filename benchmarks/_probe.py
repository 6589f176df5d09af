import sys, time, threading, statistics, numpy as np, h5py, jax, jax.numpy as jnp
jax.config.update("jax_enable_x64", True)
path = sys.argv[1]
dev = jax.devices()[0]
N = 1 << 21
raw = np.empty(N * 24 + 64, np.uint8); off = -raw.ctypes.data % 64
A = raw[off:off + N * 24].view(np.float64).reshape(N, 3); A[:] = 1.0
def t(f, n=10):
    ts = []
    for _ in range(n):
        s = time.perf_counter(); f(); ts.append(time.perf_counter() - s)
    return statistics.median(ts) * 1e3
print("device_put pageable ms", t(lambda: jax.device_put(A, dev).block_until_ready()))
try:
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    P = jax.device_put(A, pinned); P.block_until_ready()
    print("np->pinned ms", t(lambda: jax.device_put(A, pinned).block_until_ready()))
    print("pinned->device ms", t(lambda: jax.device_put(P, dev).block_until_ready()))
except Exception as e:
    print("pinned failed", e)
f = h5py.File(path, "r", rdcc_nbytes=0); ds = f["atoms/forces"]
B = np.empty((N, 3))
print("read_direct ms", t(lambda: ds.read_direct(B, np.s_[0:N], np.s_[0:N])))
stop = threading.Event(); count = [0]
def reader():
    while not stop.is_set():
        ds.read_direct(B, np.s_[0:N], np.s_[0:N]); count[0] += 1
th = threading.Thread(target=reader); th.start(); time.sleep(0.2)
c0 = count[0]; s = time.perf_counter()
m = t(lambda: jax.device_put(A, dev).block_until_ready(), 20)
el = time.perf_counter() - s; reads = count[0] - c0
stop.set(); th.join()
print("concurrent: device_put ms", m, "reads/s", reads / el, "read ms", el / max(reads, 1) * 1e3)
stop.clear(); count[0] = 0
th = threading.Thread(target=reader); th.start(); time.sleep(0.2)
c0 = count[0]; s = time.perf_counter()
m = t(lambda: np.isnan(A.sum()), 20)
el = time.perf_counter() - s; reads = count[0] - c0
stop.set(); th.join()
print("concurrent: numpy sum ms", m, "read ms", el / max(reads, 1) * 1e3)
idx = np.empty(N, np.int32); c = np.random.default_rng(0).integers(1, 32, 70000)
print("np.repeat ms", t(lambda: idx.__setitem__(slice(0, c.sum()), np.repeat(np.arange(70000, dtype=np.int32), c))))
print("nan check ms", t(lambda: np.isnan(A.sum())))
