// The Gloo transport device of every Gloo group megatronapp creates (the mapp
// backend's and the C++ trainers'): the interface the launcher names in
// GLOO_SOCKET_IFNAME (its first entry), as torch's own Gloo groups honour it,
// else the device for the hostname's address. Include after
// ProcessGroupGloo.hpp.
#pragma once

#include <cstdlib>
#include <string>

namespace mapp::torch_ext::internal {

inline auto gloo_device() {
  const char* env = std::getenv("GLOO_SOCKET_IFNAME");
  const std::string ifname = env == nullptr ? std::string() : std::string(env);
  return ifname.empty() ? c10d::ProcessGroupGloo::createDefaultDevice()
                        : c10d::ProcessGroupGloo::createDeviceForInterface(
                              ifname.substr(0, ifname.find(',')));
}

}  // namespace mapp::torch_ext::internal
