// What the launch plans need of a device (the triplet op's and the mining's), read once per
// device.
#ifndef FUSED_TRIPLET_DEVICE_FACTS_H
#define FUSED_TRIPLET_DEVICE_FACTS_H

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <mutex>

namespace fused_triplet {

struct DeviceFacts {
  int cc_major, sm_count, smem_per_block;
};

inline DeviceFacts device_facts(int device) {
  constexpr int kDevices = 64;
  static std::once_flag once[kDevices];
  static DeviceFacts facts[kDevices];
  auto read = [](int d) {
    DeviceFacts f{};
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.cc_major, cudaDevAttrComputeCapabilityMajor, d));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.sm_count, cudaDevAttrMultiProcessorCount, d));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&f.smem_per_block,
                                          cudaDevAttrMaxSharedMemoryPerBlockOptin, d));
    return f;
  };
  if (device >= kDevices) return read(device);
  std::call_once(once[device], [&] { facts[device] = read(device); });
  return facts[device];
}

}  // namespace fused_triplet

#endif  // FUSED_TRIPLET_DEVICE_FACTS_H
