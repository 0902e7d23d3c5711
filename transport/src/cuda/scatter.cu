// kvtide's staged-copy kernels, compiled with NVRTC at first use (no nvcc needed to build kvtide).
//
// One launch per staging-buffer fill. Each row of the table moves `len` bytes between a page and
// the staging buffer (at most 64 KiB: the planner cuts longer ones); each warp takes rows in a
// grid-stride loop and its 32 lanes copy the row together: 16-byte vectors when the page and the
// buffer agree modulo 16 (the planner keeps the buffer congruent with the host bytes, so whole KV
// pages usually do), else 8-, 4- or 1-byte words, with byte-wise heads and tails. Correct for any
// alignment and any length.

struct Desc {
    unsigned long long page;
    unsigned int staging_offset;
    unsigned int len;
};

#define LANES 32u

template <typename T>
__device__ __forceinline__ void copy_words(unsigned char* dst, const unsigned char* src, unsigned int len,
                                           unsigned int lane) {
    const unsigned int w = sizeof(T);
    unsigned int head = (unsigned int)((w - ((unsigned long long)dst & (w - 1))) & (w - 1));
    if (head > len) head = len;
    for (unsigned int i = lane; i < head; i += LANES) dst[i] = src[i];
    const unsigned int words = (len - head) / w;
    T* d = reinterpret_cast<T*>(dst + head);
    const T* s = reinterpret_cast<const T*>(src + head);
    unsigned int i = lane;
    const unsigned int stride = LANES;
    // Four independent loads in flight per thread before the stores.
    for (; i + 3 * stride < words; i += 4 * stride) {
        T a = s[i];
        T b = s[i + stride];
        T c = s[i + 2 * stride];
        T e = s[i + 3 * stride];
        d[i] = a;
        d[i + stride] = b;
        d[i + 2 * stride] = c;
        d[i + 3 * stride] = e;
    }
    for (; i < words; i += stride) d[i] = s[i];
    const unsigned int tail = head + words * w;
    for (unsigned int j = tail + lane; j < len; j += LANES) dst[j] = src[j];
}

__device__ __forceinline__ void copy_bytes(unsigned char* dst, const unsigned char* src, unsigned int len) {
    const unsigned int lane = threadIdx.x % LANES;
    const unsigned long long mismatch = ((unsigned long long)dst ^ (unsigned long long)src);
    if ((mismatch & 15) == 0) {
        copy_words<uint4>(dst, src, len, lane);
    } else if ((mismatch & 7) == 0) {
        copy_words<unsigned long long>(dst, src, len, lane);
    } else if ((mismatch & 3) == 0) {
        copy_words<unsigned int>(dst, src, len, lane);
    } else {
        for (unsigned int i = lane; i < len; i += LANES) dst[i] = src[i];
    }
}

// Warp index and warp count of the grid (rows are handed out per warp).
__device__ __forceinline__ unsigned int warp_id() { return (blockIdx.x * blockDim.x + threadIdx.x) / LANES; }
__device__ __forceinline__ unsigned int warp_count() { return (gridDim.x * blockDim.x) / LANES; }

// Reads: staging buffer -> pages.
extern "C" __global__ void kvtide_scatter(const unsigned char* staging, const Desc* rows, unsigned int count) {
    for (unsigned int r = warp_id(); r < count; r += warp_count()) {
        const Desc row = rows[r];
        copy_bytes(reinterpret_cast<unsigned char*>(row.page), staging + row.staging_offset, row.len);
    }
}

// Stream-bound reads of an object that was still loading: the stream waited for `gate` to leave 0
// (cuStreamWaitValue32); 1 means the bytes in the staging buffer are good, anything else that the
// load failed, and then no page is touched.
extern "C" __global__ void kvtide_scatter_gated(const unsigned char* staging, const Desc* rows, unsigned int count,
                                                const volatile unsigned int* gate) {
    __shared__ unsigned int open;
    if (threadIdx.x == 0) open = *gate;
    __syncthreads();
    if (open != 1u) return;
    for (unsigned int r = warp_id(); r < count; r += warp_count()) {
        const Desc row = rows[r];
        copy_bytes(reinterpret_cast<unsigned char*>(row.page), staging + row.staging_offset, row.len);
    }
}

// Writes: pages -> staging buffer.
extern "C" __global__ void kvtide_gather(unsigned char* staging, const Desc* rows, unsigned int count) {
    for (unsigned int r = warp_id(); r < count; r += warp_count()) {
        const Desc row = rows[r];
        copy_bytes(staging + row.staging_offset, reinterpret_cast<const unsigned char*>(row.page), row.len);
    }
}
