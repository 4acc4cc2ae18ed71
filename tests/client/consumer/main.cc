// Builds a tensor with the installed client library and decodes it back;
// opens an AttentionClient and a ClusterClient.
#include <iostream>
#include <vector>

#include "client/attention_client.h"
#include "client/cluster_client.h"

int main() {
  const std::vector<float> values = {1.0f, -2.5f, 0.125f, 3.0f};
  auto tensor = attention::client::MakeTensor(values, {2, 2},
                                              attention::v1::DTYPE_BFLOAT16);
  if (!tensor.ok()) return 1;
  auto decoded = attention::client::TensorToFloats(*tensor);
  if (!decoded.ok() || *decoded != values) return 2;
  // Constructing a client needs no server (channels connect lazily).
  auto client = attention::client::AttentionClient::Connect("localhost:1");
  if (client == nullptr) return 3;
  // Nor does a cluster client: its replicas are simply unreachable.
  auto cluster =
      attention::client::ClusterClient::Open("127.0.0.1:1,127.0.0.1:2");
  if (!cluster.ok() || (*cluster)->Replicas().size() != 2) return 4;
  std::cout << "attention-client package works" << std::endl;
  return 0;
}
