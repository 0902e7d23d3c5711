// Workload stand-ins for tests and benchmarks (never used by the store itself).

// Runs for `ns` nanoseconds of the GPU's global timer: a layer's compute of a set duration, or a
// delay that keeps a stream busy while a test changes the store underneath.
extern "C" __global__ void kvtide_spin(unsigned long long ns) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    unsigned long long start;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (;;) {
        unsigned long long now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start >= ns) break;
    }
}
