//! Builders of the `ProcessingResponse`s the picker sends to Envoy (docs/design.md §5, §11).
//!
//! Facts verified with Envoy 1.40 (docs/design.md §11): header values must travel in `raw_value` (setting
//! `value` produced an empty header) with `append_action: OVERWRITE_IF_EXISTS_OR_ADD`; the dynamic
//! metadata namespace `envoy.lb` is only kept when the filter lists it in
//! `metadata_options.receiving_namespaces.untyped`.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse, ProcessingResponse,
    StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};

/// Request header (and `envoy.lb` metadata key) carrying the chosen `ip:port`.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Dynamic metadata namespace read by the ORIGINAL_DST cluster / override-host policy.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// Request id header, set upstream and returned to the client.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// One header set with `OVERWRITE_IF_EXISTS_OR_ADD`, value in `raw_value`.
pub fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue { key: key.to_owned(), value: String::new(), raw_value: value.as_bytes().to_vec() }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// `{ "envoy.lb": { "x-gateway-destination-endpoint": endpoint } }`.
pub fn destination_metadata(endpoint: &str) -> Struct {
    let inner = Struct {
        fields: HashMap::from([(
            DESTINATION_HEADER.to_owned(),
            Value { kind: Some(Kind::StringValue(endpoint.to_owned())) },
        )]),
    };
    Struct { fields: HashMap::from([(LB_NAMESPACE.to_owned(), Value { kind: Some(Kind::StructValue(inner)) })]) }
}

/// The routing result: destination + request id headers, route cache cleared, `envoy.lb` metadata.
/// `on_headers` picks the phase the reply answers (headers-only requests are routed on headers).
pub fn routed(endpoint: &str, request_id: &str, on_headers: bool) -> ProcessingResponse {
    let common = CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers: vec![set_header(DESTINATION_HEADER, endpoint), set_header(REQUEST_ID_HEADER, request_id)],
            remove_headers: Vec::new(),
        }),
        clear_route_cache: true,
        ..Default::default()
    };
    let response = if on_headers {
        Response::RequestHeaders(HeadersResponse { response: Some(common) })
    } else {
        Response::RequestBody(BodyResponse { response: Some(common) })
    };
    ProcessingResponse {
        response: Some(response),
        dynamic_metadata: Some(destination_metadata(endpoint)),
        ..Default::default()
    }
}

/// Adds `headers` (e.g. the W3C trace context) to the request-phase header mutation of `resp`
/// (a reply built by [`routed`]); other replies are returned unchanged.
pub fn with_request_headers(mut resp: ProcessingResponse, headers: &HashMap<String, String>) -> ProcessingResponse {
    if headers.is_empty() {
        return resp;
    }
    let common = match resp.response.as_mut() {
        Some(Response::RequestHeaders(HeadersResponse { response: Some(c) }))
        | Some(Response::RequestBody(BodyResponse { response: Some(c) })) => c,
        _ => return resp,
    };
    let mutation = common.header_mutation.get_or_insert_with(HeaderMutation::default);
    let mut pairs: Vec<(&String, &String)> = headers.iter().collect();
    pairs.sort();
    for (k, v) in pairs {
        mutation.set_headers.push(set_header(k, v));
    }
    resp
}

/// The request body replaced by `body` (the model rewritten, docs/design.md §14), as the GIE
/// endpoint picker does: `content-length` set to its length in the request-phase header mutation
/// of `resp` (a reply built by [`routed`]) and, when `resp` answers the body phase (BUFFERED),
/// the body itself as its body mutation. Full duplex sends the body as streamed chunks after the
/// headers reply instead ([`streamed_body_chunks`]), so pass `None` there. Other replies are
/// returned unchanged.
pub fn with_replaced_body(mut resp: ProcessingResponse, len: usize, body: Option<Vec<u8>>) -> ProcessingResponse {
    let common = match resp.response.as_mut() {
        Some(Response::RequestHeaders(HeadersResponse { response: Some(c) }))
        | Some(Response::RequestBody(BodyResponse { response: Some(c) })) => c,
        _ => return resp,
    };
    common
        .header_mutation
        .get_or_insert_with(HeaderMutation::default)
        .set_headers
        .push(set_header("content-length", &len.to_string()));
    if let Some(body) = body {
        common.body_mutation = Some(BodyMutation { mutation: Some(Mutation::Body(body)) });
    }
    resp
}

/// Empty CONTINUE to a request-headers message.
pub fn continue_request_headers() -> ProcessingResponse {
    ProcessingResponse { response: Some(Response::RequestHeaders(HeadersResponse::default())), ..Default::default() }
}

/// Empty CONTINUE to a request-body message.
pub fn continue_request_body() -> ProcessingResponse {
    ProcessingResponse { response: Some(Response::RequestBody(BodyResponse::default())), ..Default::default() }
}

/// Largest body chunk re-emitted in one message, in bytes: well under Envoy's gRPC message limit
/// (GIE's endpoint picker uses the same 62 000).
pub const STREAMED_CHUNK_BYTES: usize = 62_000;

/// Full duplex: one request-body chunk sent back to Envoy as a `StreamedBodyResponse`.
pub fn streamed_body(body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    let common = CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                body,
                end_of_stream,
                ..Default::default()
            })),
        }),
        ..Default::default()
    };
    ProcessingResponse {
        response: Some(Response::RequestBody(BodyResponse { response: Some(common) })),
        ..Default::default()
    }
}

/// Full duplex: the whole request body, re-emitted in [`STREAMED_CHUNK_BYTES`] chunks; the last
/// carries `end_of_stream` (false when trailers follow). An empty body is one empty chunk.
pub fn streamed_body_chunks(body: Vec<u8>, end_of_stream: bool, out: &mut Vec<ProcessingResponse>) {
    if body.len() <= STREAMED_CHUNK_BYTES {
        out.push(streamed_body(body, end_of_stream));
        return;
    }
    let n = body.len().div_ceil(STREAMED_CHUNK_BYTES);
    for (i, chunk) in body.chunks(STREAMED_CHUNK_BYTES).enumerate() {
        out.push(streamed_body(chunk.to_vec(), end_of_stream && i + 1 == n));
    }
}

/// Response headers: adds `x-request-id` for the client, removes the upstream attempt count.
pub fn response_headers(request_id: &str) -> ProcessingResponse {
    let common = CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers: vec![set_header(REQUEST_ID_HEADER, request_id)],
            remove_headers: vec![super::UPSTREAM_ATTEMPTS_HEADER.to_owned()],
        }),
        ..Default::default()
    };
    ProcessingResponse {
        response: Some(Response::ResponseHeaders(HeadersResponse { response: Some(common) })),
        ..Default::default()
    }
}

/// Empty CONTINUE to a response-body chunk (the body streams through untouched).
pub fn continue_response_body() -> ProcessingResponse {
    ProcessingResponse { response: Some(Response::ResponseBody(BodyResponse::default())), ..Default::default() }
}

/// CONTINUE to trailers of either direction.
pub fn continue_trailers(request: bool) -> ProcessingResponse {
    let t = TrailersResponse::default();
    let response = if request { Response::RequestTrailers(t) } else { Response::ResponseTrailers(t) };
    ProcessingResponse { response: Some(response), ..Default::default() }
}

/// An error answered to the client directly: `status` with an OpenAI-style JSON body
/// `{"error":{"message":..,"type":..,"code":..}}`.
pub fn immediate_error(status: u16, kind: &str, message: &str, request_id: &str) -> ProcessingResponse {
    let body = serde_json::json!({ "error": { "message": message, "type": kind, "code": status } });
    let immediate = ImmediateResponse {
        status: Some(HttpStatus { code: i32::from(status) }),
        headers: Some(HeaderMutation {
            set_headers: vec![
                set_header("content-type", "application/json"),
                set_header(REQUEST_ID_HEADER, request_id),
            ],
            remove_headers: Vec::new(),
        }),
        body: body.to_string().into_bytes(),
        details: format!("kvroute_picker_{kind}"),
        ..Default::default()
    };
    ProcessingResponse { response: Some(Response::ImmediateResponse(immediate)), ..Default::default() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routed_sets_raw_value_and_metadata() {
        let r = routed("10.0.0.1:8000", "rid", false);
        let Some(Response::RequestBody(b)) = &r.response else { panic!("not a body response") };
        let common = b.response.as_ref().unwrap();
        assert!(common.clear_route_cache);
        let h = &common.header_mutation.as_ref().unwrap().set_headers[0];
        assert_eq!(h.header.as_ref().unwrap().raw_value, b"10.0.0.1:8000");
        assert!(h.header.as_ref().unwrap().value.is_empty());
        assert_eq!(h.append_action, HeaderAppendAction::OverwriteIfExistsOrAdd as i32);
        let md = r.dynamic_metadata.unwrap();
        let Some(Kind::StructValue(lb)) = &md.fields[LB_NAMESPACE].kind else { panic!("no envoy.lb") };
        assert_eq!(lb.fields[DESTINATION_HEADER].kind, Some(Kind::StringValue("10.0.0.1:8000".into())));
    }

    #[test]
    fn immediate_error_is_json() {
        let r = immediate_error(404, "not_found_error", "model `x` does not exist", "rid");
        let Some(Response::ImmediateResponse(i)) = r.response else { panic!() };
        assert_eq!(i.status.unwrap().code, 404);
        let v: serde_json::Value = serde_json::from_slice(&i.body).unwrap();
        assert_eq!(v["error"]["code"], 404);
        assert_eq!(v["error"]["type"], "not_found_error");
    }
}
