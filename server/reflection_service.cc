#include "server/reflection_service.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>

#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/client_string.h"

namespace attention::server {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::DescriptorPool;
using google::protobuf::FieldDescriptor;
using google::protobuf::FileDescriptor;
using grpc::reflection::v1alpha::FileDescriptorResponse;
using Request = ReflectionService::Request;
using Response = ReflectionService::Response;

const DescriptorPool& Pool() { return *DescriptorPool::generated_pool(); }

// The largest request answered: a host name and a symbol or file name take
// a few hundred bytes. An answer echoes the host and the whole request, so
// a larger one would make a reply about twice the request's size.
constexpr size_t kMaxAnsweredRequestBytes = size_t{64} << 10;

// `file`, then each file it imports not yet in `sent`, depth first.
void AddFileAndImports(const FileDescriptor& file,
                       absl::flat_hash_set<std::string>& sent,
                       FileDescriptorResponse* out) {
  if (!sent.insert(file.name()).second) return;
  google::protobuf::FileDescriptorProto proto;
  file.CopyTo(&proto);
  proto.SerializeToString(out->add_file_descriptor_proto());
  for (int i = 0; i < file.dependency_count(); ++i) {
    AddFileAndImports(*file.dependency(i), sent, out);
  }
}

void SetError(grpc::StatusCode code, std::string message, Response* response) {
  response->mutable_error_response()->set_error_code(static_cast<int>(code));
  response->mutable_error_response()->set_error_message(std::move(message));
}

// The answer for `file` (null: NOT_FOUND for `what`).
void AnswerFile(const FileDescriptor* file, const std::string& what,
                Response* response) {
  if (file == nullptr) {
    SetError(grpc::StatusCode::NOT_FOUND,
             absl::StrCat(what, " is not known to this server"), response);
    return;
  }
  absl::flat_hash_set<std::string> sent;
  AddFileAndImports(*file, sent, response->mutable_file_descriptor_response());
}

// The message type named `name`, or null with NOT_FOUND in `response`.
const Descriptor* MessageType(const std::string& name, Response* response) {
  const Descriptor* type = Pool().FindMessageTypeByName(name);
  if (type == nullptr) {
    SetError(grpc::StatusCode::NOT_FOUND,
             absl::StrCat("message type ", QuoteClientString(name),
                          " is not known to this server"),
             response);
  }
  return type;
}

void AnswerExtension(const grpc::reflection::v1alpha::ExtensionRequest& ask,
                     Response* response) {
  const Descriptor* type = MessageType(ask.containing_type(), response);
  if (type == nullptr) return;
  const FieldDescriptor* extension =
      Pool().FindExtensionByNumber(type, ask.extension_number());
  AnswerFile(extension == nullptr ? nullptr : extension->file(),
             absl::StrCat("extension ", ask.extension_number(), " of ",
                          QuoteClientString(ask.containing_type())),
             response);
}

void AnswerExtensionNumbers(const std::string& name, Response* response) {
  const Descriptor* type = MessageType(name, response);
  if (type == nullptr) return;
  std::vector<const FieldDescriptor*> extensions;
  Pool().FindAllExtensions(type, &extensions);
  auto* numbers = response->mutable_all_extension_numbers_response();
  numbers->set_base_type_name(type->full_name());
  for (const FieldDescriptor* extension : extensions) {
    numbers->add_extension_number(extension->number());
  }
}

// A bidirectional stream: one answer per request, in order.
class ReflectionReactor final
    : public grpc::ServerBidiReactor<Request, Response> {
 public:
  ReflectionReactor(const ReflectionService* service,
                    grpc::CallbackServerContext* context,
                    UnparsedReads* unparsed_reads)
      : service_(service), context_(context), unparsed_reads_(unparsed_reads) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(
          unparsed_reads_ != nullptr && unparsed_reads_->Take(context_)
              ? grpc::Status(
                    grpc::StatusCode::INVALID_ARGUMENT,
                    std::string(UnparsedRequest(
                                    "/grpc.reflection.v1alpha.ServerReflection/"
                                    "ServerReflectionInfo")
                                    .message()))
              : grpc::Status::OK);
      return;
    }
    response_ = service_->Answer(request_);
    StartWrite(&response_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED,
                          "the client closed the reflection stream"));
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  const ReflectionService* const service_;
  grpc::CallbackServerContext* const context_;
  UnparsedReads* const unparsed_reads_;
  Request request_;
  Response response_;
};

}  // namespace

void ReflectionService::SetServices(std::vector<std::string> names) {
  absl::MutexLock lock(&mu_);
  services_ = std::move(names);
}

Response ReflectionService::Answer(const Request& request) const {
  Response response;
  if (const size_t bytes = request.ByteSizeLong();
      bytes > kMaxAnsweredRequestBytes) {
    // Neither the host nor the request is echoed.
    SetError(grpc::StatusCode::INVALID_ARGUMENT,
             absl::StrCat("the reflection request is ", bytes,
                          " bytes; this server answers requests of at most ",
                          kMaxAnsweredRequestBytes,
                          " (a host name and a symbol or file name)"),
             &response);
    return response;
  }
  response.set_valid_host(request.host());
  *response.mutable_original_request() = request;
  switch (request.message_request_case()) {
    case Request::kFileByFilename:
      AnswerFile(
          Pool().FindFileByName(request.file_by_filename()),
          absl::StrCat("file ", QuoteClientString(request.file_by_filename())),
          &response);
      break;
    case Request::kFileContainingSymbol:
      AnswerFile(
          Pool().FindFileContainingSymbol(request.file_containing_symbol()),
          absl::StrCat("symbol ",
                       QuoteClientString(request.file_containing_symbol())),
          &response);
      break;
    case Request::kFileContainingExtension:
      AnswerExtension(request.file_containing_extension(), &response);
      break;
    case Request::kAllExtensionNumbersOfType:
      AnswerExtensionNumbers(request.all_extension_numbers_of_type(),
                             &response);
      break;
    case Request::kListServices: {
      auto* list = response.mutable_list_services_response();
      absl::MutexLock lock(&mu_);
      for (const std::string& name : services_) {
        list->add_service()->set_name(name);
      }
      break;
    }
    case Request::MESSAGE_REQUEST_NOT_SET:
      // gRPC's own service answers UNIMPLEMENTED too.
      SetError(grpc::StatusCode::UNIMPLEMENTED,
               "the request asks nothing: set one of file_by_filename, "
               "file_containing_symbol, file_containing_extension, "
               "all_extension_numbers_of_type or list_services",
               &response);
      break;
  }
  return response;
}

grpc::ServerBidiReactor<ReflectionService::Request,
                        ReflectionService::Response>*
ReflectionService::ServerReflectionInfo(grpc::CallbackServerContext* context) {
  return new ReflectionReactor(this, context, unparsed_reads_);
}

}  // namespace attention::server
