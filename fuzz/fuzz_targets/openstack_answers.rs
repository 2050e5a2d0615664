//! What Neutron and Nova answer, as the controller reads it: the real openstack_sdk request of each call
//! `lb-controller`'s `SdkCloud` makes that reads an answer, sent to an in-memory cloud (`CannedCloud`, standing in
//! for the HTTP transport only) that answers with the input's status and body; then the controller's reading
//! (`sdk::answer`, the `parse_*` functions). Input: one byte choosing the call, three ASCII digits of HTTP status,
//! the body. Whatever comes back: no panic; a non-2xx status is never a success; an unreadable 2xx answer is an
//! error that says what was wrong; what is read has the IDs and addresses the controllers act on.
#![no_main]

use async_trait::async_trait;
use bytes::Bytes;
use http::{request::Builder, HeaderMap, Response};
use lb_controller::openstack::sdk::{
    answer, parse_created_server, parse_fip, parse_list, parse_port, parse_router_routes, parse_rule,
    parse_server, parse_server_group, parse_sg,
};
use lb_controller::openstack::{CloudErrorKind, CloudResult};
use openstack_sdk::api::compute::v2 as nova;
use openstack_sdk::api::network::v2 as neutron;
use openstack_sdk::api::{ApiError, AsyncClient, RestClient, RestEndpoint};
use openstack_sdk::types::{ApiVersion, BoxedAsyncRead, ServiceType};
use openstack_sdk::RestError;
use openstack_sdk_core::catalog::ServiceEndpoint;
use serde_json::Value;

/// Answers every request with one status and body.
struct CannedCloud {
    status: u16,
    body: Bytes,
}

impl RestClient for CannedCloud {
    type Error = RestError;
    fn get_current_project(&self) -> Option<openstack_sdk_auth_core::types::Project> {
        None
    }
}

#[async_trait]
impl AsyncClient for CannedCloud {
    async fn rest_async(
        &self,
        _request: Builder,
        _body: Vec<u8>,
    ) -> Result<Response<Bytes>, ApiError<Self::Error>> {
        Ok(Response::builder()
            .status(self.status)
            .body(self.body.clone())
            .expect("status checked"))
    }

    async fn rest_read_body_async(
        &self,
        _request: Builder,
        _body: BoxedAsyncRead,
    ) -> Result<Response<Bytes>, ApiError<Self::Error>> {
        unreachable!("the controller uploads nothing")
    }

    async fn download_async(
        &self,
        _request: Builder,
        _body: Vec<u8>,
    ) -> Result<(HeaderMap, BoxedAsyncRead), ApiError<Self::Error>> {
        unreachable!("the controller downloads nothing")
    }

    async fn get_service_endpoint(
        &self,
        service_type: &ServiceType,
        _version: Option<&ApiVersion>,
    ) -> Result<ServiceEndpoint, ApiError<Self::Error>> {
        let (url, version) = match service_type {
            ServiceType::Compute => ("http://cloud.invalid/compute/v2.1/", ApiVersion::new(2, 1)),
            _ => ("http://cloud.invalid/network/v2.0/", ApiVersion::new(2, 0)),
        };
        Ok(ServiceEndpoint::new(
            url.parse().expect("valid url"),
            version,
        ))
    }
}

async fn ask<E: RestEndpoint + Sync>(cloud: &CannedCloud, req: E) -> CloudResult<Value> {
    answer("fuzz", req, cloud).await
}

fn ids<T>(items: CloudResult<Vec<T>>, id: impl Fn(&T) -> &str) -> CloudResult<usize> {
    let items = items?;
    assert!(items.iter().all(|i| !id(i).is_empty()), "an empty ID read");
    Ok(items.len())
}

/// Runs call `op` against `cloud`; the number of resources read.
async fn call(op: u8, cloud: &CannedCloud) -> CloudResult<usize> {
    const W: &str = "fuzz";
    match op % 13 {
        0 => {
            let req = neutron::security_group::list::Request::builder()
                .name("sg")
                .build()
                .unwrap();
            ids(parse_list(W, &ask(cloud, req).await?, parse_sg), |g| &g.id)
        }
        1 => {
            let req = neutron::security_group::create::Request::builder()
                .security_group(
                    neutron::security_group::create::SecurityGroupBuilder::default()
                        .name("sg")
                        .build()
                        .unwrap(),
                )
                .build()
                .unwrap();
            let g = parse_sg(W, &ask(cloud, req).await?)?;
            assert!(g.rules.iter().all(|r| !r.id.is_empty()));
            Ok(1)
        }
        2 => {
            use neutron::security_group_rule::create::{Direction, SecurityGroupRuleBuilder};
            let req = neutron::security_group_rule::create::Request::builder()
                .security_group_rule(
                    SecurityGroupRuleBuilder::default()
                        .security_group_id("sg")
                        .direction(Direction::Ingress)
                        .build()
                        .unwrap(),
                )
                .build()
                .unwrap();
            let r = parse_rule(W, &ask(cloud, req).await?)?;
            assert!(!r.id.is_empty());
            Ok(1)
        }
        3 => {
            let req = neutron::floatingip::list::Request::builder()
                .build()
                .unwrap();
            let fips = parse_list(W, &ask(cloud, req).await?, parse_fip)?;
            assert!(fips.iter().all(|f| !f.address.is_empty()));
            ids(Ok(fips), |f| &f.id)
        }
        4 => {
            let req = neutron::floatingip::get::Request::builder()
                .id("f")
                .build()
                .unwrap();
            ids(
                parse_fip(W, &ask(cloud, req).await?).map(|f| vec![f]),
                |f| &f.id,
            )
        }
        5 => {
            let req = neutron::floatingip::create::Request::builder()
                .floatingip(
                    neutron::floatingip::create::FloatingipBuilder::default()
                        .floating_network_id("ext")
                        .build()
                        .unwrap(),
                )
                .build()
                .unwrap();
            ids(
                parse_fip(W, &ask(cloud, req).await?).map(|f| vec![f]),
                |f| &f.id,
            )
        }
        6 => {
            let req = neutron::port::list::Request::builder()
                .name("p")
                .build()
                .unwrap();
            let ports = parse_list(W, &ask(cloud, req).await?, parse_port)?;
            for p in &ports {
                assert!(p.fixed_ips.iter().all(|f| !f.ip_address.is_empty()));
                let _ = p.primary_ip();
            }
            ids(Ok(ports), |p| &p.id)
        }
        7 => {
            let req = neutron::port::get::Request::builder()
                .id("p")
                .build()
                .unwrap();
            ids(
                parse_port(W, &ask(cloud, req).await?).map(|p| vec![p]),
                |p| &p.id,
            )
        }
        8 => {
            let req = nova::server_group::list_20::Request::builder()
                .build()
                .unwrap();
            let groups = parse_list(W, &ask(cloud, req).await?, parse_server_group)?;
            assert!(groups.iter().all(|g| !g.policy.is_empty()));
            ids(Ok(groups), |g| &g.id)
        }
        9 => {
            let req = nova::server::list_detailed_21::Request::builder()
                .name("^s$")
                .build()
                .unwrap();
            ids(parse_list(W, &ask(cloud, req).await?, parse_server), |s| {
                &s.id
            })
        }
        10 => {
            let req = nova::server::get_20::Request::builder()
                .id("s")
                .build()
                .unwrap();
            let s = parse_server(W, &ask(cloud, req).await?)?;
            assert!(!s.status.is_empty());
            ids(Ok(vec![s]), |s| &s.id)
        }
        11 => {
            let req = neutron::router::get::Request::builder()
                .id("r")
                .build()
                .unwrap();
            let routes = parse_router_routes(W, &ask(cloud, req).await?)?;
            assert!(routes.iter().all(|r| !r.nexthop.is_empty()));
            ids(Ok(routes), |r| &r.destination)
        }
        _ => {
            use nova::server::create_294::{NetworksBuilder, ServerBuilder, ServerNetworks};
            let mut b = ServerBuilder::default();
            b.name("s")
                .flavor_ref("f")
                .image_ref("i")
                .networks(ServerNetworks::F1(vec![NetworksBuilder::default()
                    .port(Some("p".into()))
                    .build()
                    .unwrap()]));
            let req = nova::server::create_294::Request::builder()
                .server(b.build().unwrap())
                .build()
                .unwrap();
            let id = parse_created_server(W, &ask(cloud, req).await?)?;
            assert!(!id.is_empty());
            Ok(1)
        }
    }
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&op, rest)) = data.split_first() else {
        return;
    };
    if rest.len() < 3 {
        return;
    }
    let Some(status) = std::str::from_utf8(&rest[..3])
        .ok()
        .and_then(|s| s.parse::<u16>().ok())
        .filter(|s| (100..=999).contains(s))
    else {
        return;
    };
    let cloud = CannedCloud {
        status,
        body: Bytes::copy_from_slice(&rest[3..]),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    match rt.block_on(call(op, &cloud)) {
        Ok(_) => assert!(
            (200..300).contains(&status),
            "status {status} read as a success"
        ),
        Err(e) if (200..300).contains(&status) => {
            // A 2xx answer the controller cannot use: an error that says what was wrong with it.
            assert_eq!(e.kind, CloudErrorKind::Other, "{e}");
            assert!(e.message.starts_with("unreadable answer: "), "{e}");
            assert!(e.message.len() > "unreadable answer: ".len(), "{e}");
        }
        Err(e) => assert!(!e.operation.is_empty(), "{e}"),
    }
});
